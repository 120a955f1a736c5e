"""A request and its state; only the scheduler changes these fields after creation."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from eyas.core.metrics import SpecStats
from eyas.sampling.grammar import GrammarState
from eyas.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)  # a request is itself, not its fields: compared (and hashed) by identity
class Request:
    request_id: str
    token_ids: list[int]  # the prompt, then every committed output token
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # the user's seed, or one drawn at creation: every request samples with keyed noise
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not pass this (max_model_len)
    grammar: GrammarState | None = None  # structured output: its position after the committed outputs
    arrival_time: float = field(default_factory=time.perf_counter)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    spec_stats: SpecStats = field(default_factory=SpecStats)
    from_draft: list[bool] = field(default_factory=list)  # per output token: an accepted draft (else the target's own)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - self.num_prompt_tokens
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)
