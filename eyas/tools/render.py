"""A conversation with tool calls and tool results, rendered into a prompt by the model's chat template.

Messages are OpenAI's dicts: an assistant message may carry ``tool_calls`` (``[{"id", "type":
"function", "function": {"name", "arguments"}}]``, arguments as JSON text or an object) and a
``role: "tool"`` message answers one of them by ``tool_call_id``. Two renderings, picked by the template:

* **native**: a template that writes one of the known call syntaxes itself (``eyas.tools.syntaxes``: Hermes's
  ``<tool_call>`` as Qwen's do, Llama 3.x's JSON, Mistral's ``[TOOL_CALLS]``) gets ``tools=`` and the
  messages as Hugging Face passes them (arguments as objects, call ids as the syntax's templates accept them);
* **generic**: any other template (SmolLM2's among them) gets plain messages: the tools are described
  in the system message (appended to the conversation's own, or a new first message), an assistant's
  calls are written into its content in Hermes's syntax, and tool results become a user message of
  ``<tool_response>`` blocks (consecutive results share one message).

Nothing is dropped: a shape neither rendering can carry is a ValueError naming the message and field.
``continue_final_message``: the prompt ends inside the final assistant message (a prefill the reply continues).
"""

from __future__ import annotations

import json

from eyas.model.tokenizer import Tokenizer
from eyas.tools.spec import ToolRequest
from eyas.tools.syntax import CallSyntax
from eyas.tools.syntaxes import GENERIC, for_template

ROLES = ("system", "developer", "user", "assistant", "tool")
PREFILL_MARK = "\x00eyas-prefill\x00"
GENERIC_PREAMBLE = (
    "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with its name and arguments as JSON inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": <arguments object>}}\n</tool_call>\n"
    "A function's result comes back inside <tool_response></tool_response> tags.")  # GENERIC's syntax


TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")  # set here


def render_chat(tokenizer: Tokenizer, messages: list[dict], tools: ToolRequest | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """The prompt text; ValueError naming ``messages[i].field`` (or the template's own refusal, as ValueError).
    ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``); the ones eyas sets itself are refused."""
    if template_kwargs is not None:
        taken = sorted(set(template_kwargs) & set(TEMPLATE_VARIABLES)) if isinstance(template_kwargs, dict) else None
        if taken is None or taken:
            raise ValueError(f"chat_template_kwargs: must be an object of template variables other than "
                             f"{', '.join(TEMPLATE_VARIABLES)}" + (f"; got {', '.join(taken)}" if taken else ""))
    checked = check_messages(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt; "
                             "set add_generation_prompt to false")
        if checked[-1]["role"] != "assistant" or checked[-1]["tool_calls"]:
            raise ValueError("continue_final_message: the last message must be an assistant message with text "
                             "(the prefill to continue)")
        prefill = checked[-1]["content"]
        checked[-1] = {**checked[-1], "content": PREFILL_MARK}
    syntax, native = for_template(tokenizer.chat_template)
    extra = dict(template_kwargs or {})
    if native and tools is not None:
        extra["tools"] = [t.as_openai() for t in tools.tools]
    rendered = _native(checked, syntax) if native else _generic(checked, tools)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra)
    except ValueError:
        raise
    except Exception as error:  # the template itself refused the conversation (e.g. roles out of order)
        raise ValueError(f"messages: the chat template refused them ({error})") from None
    if continue_final_message:
        text = text[:text.rindex(PREFILL_MARK)] + prefill
    return text


def check_messages(messages: list[dict]) -> list[dict]:
    """Normalised copies (``role``, ``content`` text, ``tool_calls`` with parsed arguments, ``tool_call_id``)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}.content: must be text")
        calls = _calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else []
        if m.get("tool_calls") and role != "assistant":
            raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls, not {role!r}")
        call_ids.update(c["id"] for c in calls)
        entry = {"role": "system" if role == "developer" else role, "content": content or "", "tool_calls": calls}
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
            if call_id not in call_ids:
                raise ValueError(f"{where}.tool_call_id: {call_id!r} answers no earlier assistant tool call "
                                 f"(ids so far: {sorted(call_ids)})")
            entry["tool_call_id"] = call_id
        out.append(entry)
    return out


def _calls(value, where: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be a list of function calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where}[{j}]: must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}[{j}].function.name: must be the called function's name")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments: {arguments[:60]!r} is not JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{j}].function.arguments: must be a JSON object")
        calls.append({"id": str(call.get("id") or f"call_{j}"), "name": name, "arguments": arguments})
    return calls


def _native(messages: list[dict], syntax: CallSyntax) -> list[dict]:
    out = []
    for m in messages:
        entry = {"role": m["role"], "content": m["content"]}
        if m["tool_calls"]:
            entry["tool_calls"] = [{"id": syntax.native_id(c["id"]), "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}}
                                   for c in m["tool_calls"]]
        if "tool_call_id" in m:
            entry["tool_call_id"] = syntax.native_id(m["tool_call_id"])
        out.append(entry)
    return out


def _generic(messages: list[dict], tools: ToolRequest | None) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        content = m["content"]
        if m["tool_calls"]:
            content += GENERIC.calls_text([(c["name"], c["arguments"]) for c in m["tool_calls"]])
        out.append({"role": m["role"], "content": content})
    if tools is not None and tools.tools:
        listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                       ensure_ascii=False) for t in tools.tools)
        preamble = GENERIC_PREAMBLE.format(tools=listing)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return [{"role": m["role"], "content": m["content"]} for m in out]
