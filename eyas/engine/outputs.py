"""What a request hands back: vLLM-shaped output objects with per-request timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_output_tokens: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (decode speed seen by the user)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, the sampled one included
    from_draft: list[bool] = field(default_factory=list)  # per token: an accepted draft (True) or the target's sample
    tool_calls: list | None = None  # LLM.chat with tools: the reply's calls (eyas.tools.ToolCall), else None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' logprobs (vLLM's field), when logprobs were asked for; else None."""
        if self.logprobs is None:
            return None
        return sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    spec_metrics: dict = field(default_factory=dict)
    hidden_states_path: str | None = None  # extract_hidden_states: the request's safetensors file
    # SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (its own and the top-n); token 0 None
    prompt_logprobs: list[dict[int, float] | None] | None = None
