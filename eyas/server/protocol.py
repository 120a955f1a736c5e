"""The OpenAI request bodies the server accepts (pydantic), and their translation to ``SamplingParams``.

Fields the API defines and eyas does not implement are refused by name (400) rather than ignored;
fields nobody defines are ignored, as the OpenAI API and vLLM do. Sampling fields left out take the
model's defaults (``generation_config.json``, or the built-in model's card), then the API's.
vLLM's extensions are accepted: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``allowed_token_ids``,
``truncate_prompt_tokens``, ``skip_special_tokens``; and eyas's ``speculate`` (false: this request opts out of
speculative decoding) and ``return_token_sources`` (each stream chunk's choice lists its new tokens as
``{"text", "draft"}``: the playground colours accepted drafts with it).

Structured output, at most one of: OpenAI's ``response_format`` (``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or ``{"type": "text"}``),
vLLM's ``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``,
vLLM 0.12 on) and vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eyas.sampling.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    speculate: bool = True
    return_token_sources: bool = False  # stream chunks name each new token and whether it was an accepted draft
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, defaults: dict, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``defaults``: the model's sampling defaults; ``max_tokens``: already resolved. ValueError names the field."""
        def pick(name: str, api_default):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, api_default)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, speculate=self.speculate,
            presence_penalty=pick("presence_penalty", 0.0), frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), logit_bias=self.logit_bias,
            structured_output=self.structured_output())

    def structured_output(self) -> dict | None:
        """``SamplingParams.structured_output`` from whichever field the request used; ValueError names it."""
        given = {name: getattr(self, name) for name in ("response_format", "structured_outputs", *_GUIDED)
                 if getattr(self, name) is not None}
        if len(given) > 1:
            raise ValueError(f"{next(iter(given))}: give one way of structured output, not {', '.join(given)}")
        if not given:
            return None
        (name, value), = given.items()
        if name in _GUIDED:
            return {_GUIDED[name]: value}
        if name == "structured_outputs":
            unknown = sorted(set(value) - set(_GUIDED.values()) - {"json_object"})
            if unknown:
                raise ValueError(f"structured_outputs: {unknown} not supported; give one of json, json_object, regex, "
                                 f"choice, grammar")
            return dict(value)
        return format_output(value.get("type"), (value.get("json_schema") or {}).get("schema"), "response_format",
                             "json_schema.schema")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def format_output(kind, schema, field: str, schema_field: str) -> dict | None:
    """An OpenAI output format (``response_format``, the Responses API's ``text.format``) as
    ``SamplingParams.structured_output``; ValueError naming ``field``."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if schema is None:
            raise ValueError(f"{field}: type json_schema needs {schema_field} (the JSON schema)")
        return {"json": schema}
    raise ValueError(f"{field}: type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list | None = None  # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # tool: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type not in ("text", "input_text", "output_text"):
                raise ValueError(f"content part type '{part.type}' is not supported (text only)")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message: a prefill
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template
    tools: Any = None  # checked by eyas.tools.ToolRequest, whose errors name the field inside it
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    def conversation(self) -> list[dict]:
        """The messages as dicts for ``eyas.tools.render``, which checks their tool fields."""
        out = []
        for i, m in enumerate(self.messages):
            try:
                entry = {"role": m.role, "content": m.text()}
            except ValueError as error:
                raise ValueError(f"messages[{i}].content: {error}") from None
            for field in ("tool_calls", "tool_call_id"):
                if getattr(m, field) is not None:
                    entry[field] = getattr(m, field)
            out.append(entry)
        return out


# fields of the OpenAI API eyas does not implement: refused by name instead of silently ignored
UNSUPPORTED = {
    CompletionRequest: {"suffix": "suffix (insertion) is not supported", "best_of": "best_of is not supported; use n"},
    ChatCompletionRequest: {"functions": "the deprecated functions API is not supported; send tools",
                            "function_call": "the deprecated functions API is not supported; send tool_choice"},
}
