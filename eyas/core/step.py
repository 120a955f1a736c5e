"""One step's plan and result: what the scheduler hands the runner, and what the runner hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eyas.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # tokens already in the cache (positions start .. start + num_new_tokens - 1 run now)
    num_new_tokens: int  # committed tokens fed this step (a prompt chunk, or 1 when decoding)
    draft_token_ids: list[int]  # proposed tokens verified after the committed ones
    block_tables: list[list[int]]  # one per KV-cache group (live view of the manager's table)
    will_sample: bool  # this step reaches the request's last token, so the target samples a new one
    draft_forced: list[bool]  # per draft: its grammar admitted that token only (always accepted)
    draft_probs: Any = None  # [num drafts, vocab] the drafter's probabilities of them (rejection sampling), or None


@dataclass(frozen=True)
class DoneRequest:
    """A request that left the engine for good this step (finished, stopped or aborted; not preempted)."""

    request_id: str
    token_ids: list[int]  # the prompt, then every committed output token
    num_prompt_tokens: int
    # its blocks, whose contents last until the next forward, when it finished normally and took part in
    # speculation; None after an abort or with SamplingParams(speculate=False)
    block_tables: list[list[int]] | None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_tokens: int
    preempted: list[str]
    # sampling request id -> drafts the next step would verify for it (``Scheduler._expected_drafts``)
    expected_drafts: dict[str, int]


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> tokens emitted this step (accepted drafts + 1)
    num_drafts: dict[str, int]  # request id -> drafts verified this step
    logprobs: dict[str, list[dict[int, float]]]  # request id -> per emitted token {token id: logprob}
    drafts: dict[str, list[int]]  # request id -> draft tokens proposed for the next step
    forced: dict[str, list[bool]] = field(default_factory=dict)  # request id -> per draft: forced by its grammar
    # request id -> [num drafts, vocab] the drafter's probabilities of them, kept for rejection sampling
    draft_probs: dict[str, Any] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: request id -> (index of the first prompt token read, per token {id: logprob})
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
