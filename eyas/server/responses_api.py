"""OpenAI's Responses API, stateless: a request's ``input`` becomes chat messages, a reply becomes output items.

Nothing is stored: ``previous_response_id`` is refused (400) and a client keeps the conversation by
sending the earlier output items back in ``input``, as with ``store: false``. Input items:

* a string: one user message;
* ``{"role": "user" | "system" | "developer" | "assistant", "content": text or [{"type": "input_text" |
  "output_text", "text"}]}`` (``"type": "message"`` optional);
* ``{"type": "function_call", "call_id", "name", "arguments"}``: joins the assistant message before it
  (or starts one), as a tool call;
* ``{"type": "function_call_output", "call_id", "output"}``: a tool message.

``instructions`` is a system message in front. ``text.format`` (``{"type": "json_schema", "schema"}``,
``"json_object"`` or ``"text"``) is ``response_format``; tools are flat (``{"type": "function", "name",
"parameters"}``). The reply gives one ``message`` item (when it has text) and one ``function_call`` item per call.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ConfigDict

from eyas.engine.outputs import CompletionOutput, RequestOutput
from eyas.server.protocol import _Sampling, format_output
from eyas.server.tool_stream import call_id
from eyas.tools import ToolRequest, parse_reply


class ResponsesRequest(_Sampling):
    model_config = ConfigDict(extra="ignore")
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None

    def messages(self) -> list[dict]:
        """Chat messages of ``instructions`` and ``input``; ValueError naming ``input[i].field``."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
            else:
                raise ValueError(f"input[{i}].type: {kind!r} is not one of message, function_call, "
                                 f"function_call_output")
        return out

    def structured_output(self) -> dict | None:
        """``text.format`` as ``SamplingParams.structured_output``; ValueError naming ``text``."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return format_output(fmt.get("type"), fmt.get("schema"), "text", "format.schema")


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be text or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise ValueError(f"{where}[{j}]: only text parts (input_text, output_text) are supported")
        parts.append(part.get("text") or "")
    return "".join(parts)


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(completion: CompletionOutput, tools: ToolRequest | None) -> list[dict]:
    if tools is None or not tools.callable:
        return [message_item(completion.text)]
    reply = parse_reply(completion.text, tools.syntax)
    items = [message_item(reply.content)] if reply.content or not reply.calls else []
    return items + [call_item(call_id(), c.name, c.arguments) for c in reply.calls]


def response_body(response_id: str, body: ResponsesRequest, model: str, created: int, output: list[dict],
                  final: RequestOutput | None) -> dict:
    """The response object; ``final``: the finished request (None: still in progress)."""
    completion = final.outputs[0] if final is not None else None
    status = "in_progress" if final is None else ("incomplete" if completion.finish_reason == "length"
                                                  else "completed")
    usage = None
    if final is not None:
        prompt, generated = len(final.prompt_token_ids), len(completion.token_ids)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + generated}
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
            "metadata": body.metadata or {}, "usage": usage}
