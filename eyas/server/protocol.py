"""The OpenAI request bodies the server accepts (pydantic), and their translation to ``SamplingParams``.

Fields the API defines and eyas does not implement are refused by name (400) rather than ignored;
fields nobody defines are ignored, as the OpenAI API and vLLM do. Sampling fields left out take the
model's defaults (``generation_config.json``, or the built-in model's card), then the API's.
vLLM's extensions are accepted: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``; and eyas's ``speculate`` (false: this
request opts out of speculative decoding) and ``return_token_sources`` (each stream chunk's choice lists
its new tokens as ``{"text", "draft"}``: the playground colours accepted drafts with it).
"""

from __future__ import annotations

from typing import Literal

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
    skip_special_tokens: bool = True
    speculate: bool = True
    return_token_sources: bool = False  # stream chunks name each new token and whether it was an accepted draft
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, defaults: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """``defaults``: the model's sampling defaults; ``max_tokens``: already resolved. ValueError names the field."""
        def pick(name: str, api_default):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, api_default)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, speculate=self.speculate,
            presence_penalty=pick("presence_penalty", 0.0), frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), logit_bias=self.logit_bias)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"messages: content part type '{part.type}' is not supported (text only)")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    response_format: dict | None = None

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# fields of the OpenAI API eyas does not implement: refused by name instead of silently ignored
UNSUPPORTED = {
    CompletionRequest: {"suffix": "suffix (insertion) is not supported", "best_of": "best_of is not supported; use n"},
    ChatCompletionRequest: {"tools": "tool calling is not supported",
                            "response_format": "response_format (structured output) is not supported yet"},
}
