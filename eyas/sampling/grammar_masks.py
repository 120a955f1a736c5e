"""The token masks of a step's verify rows, computed on a worker thread while the target's forward runs.

A request with a grammar owns ``num_drafts + 1`` consecutive logits rows; row j is the token after
its committed output plus drafts 0..j-1, so it is masked by the grammar position reached there.
Everything the masks depend on (the committed grammar positions, the drafts) is known when the
step is planned, so the runner starts the masks before the forward and collects them after it;
llguidance computes them with the GIL released, in its own threads.

Example (k = 2, vocabulary 6): a request whose grammar allows {1, 2} now, {3} after draft 1 and
{5} after drafts [1, 3] owns rows 0..2, drafts [1, 3]: allowed rows ``[[F,T,T,F,F,F],
[F,F,F,T,F,F], [F,F,F,F,F,T]]``. A row past a draft that ends the grammar (an end-of-sequence
token) has nothing left to allow; it allows the end-of-sequence tokens, so its logits stay finite
(the scheduler drops whatever it emits). Rows within reach of the request's ``max_tokens`` allow only the
budget-aware close's token where it binds (``GrammarState.closing_token``), as the drafts were planned.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from eyas.sampling.grammar import GrammarState, allowed_tokens, one_token_mask
from eyas.sampling.grammar_budget import HORIZON
from eyas.sampling.row_ops import argmax


@dataclass
class GrammarMasks:
    allowed: torch.Tensor  # [N, V] bool over the step's logits rows (rows without a grammar: all True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """New logits [N, V] with the disallowed tokens at -inf (the input is kept for raw logprobs)."""
        return logits.masked_fill(~self.allowed, -math.inf)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``argmax(apply(logits))`` [N], masking only the rows whose best token is disallowed: where that token is
        allowed, no token before it ties it, so the masked row's argmax is the same."""
        tokens = argmax(logits)
        off = (~self.allowed.gather(1, tokens[:, None])).squeeze(1).nonzero().squeeze(1)  # [N']
        if len(off):
            tokens[off] = argmax(logits[off].masked_fill(~self.allowed[off], -math.inf))
        return tokens

    def restrict(self, draft_probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Draft probabilities [R, k, V] renormalised over what the grammar allows at their rows [R, k].

        Drafts the grammar forbids were cut before verification, so a kept draft was drawn from q
        restricted to the allowed tokens; the rejection sampler must use that distribution.
        """
        q = draft_probs * self.allowed[rows]
        return q / q.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(q.dtype).tiny)


@dataclass
class GrammarTimings:
    """Cumulative cost of structured output, over the steps that had a request with a grammar."""

    steps: int = 0
    mask_seconds: float = 0.0  # computing the verify rows' masks (on the worker thread)
    wait_seconds: float = 0.0  # the step waiting for them after the forward (what the overlap did not hide)
    draft_seconds: float = 0.0  # walking drafts under the grammar (cuts and forced tokens)

    def as_dict(self) -> dict:
        per_step = 1e3 / self.steps if self.steps else 0.0
        return {"steps": self.steps, "mask_ms_per_step": self.mask_seconds * per_step,
                "wait_ms_per_step": self.wait_seconds * per_step, "draft_ms_per_step": self.draft_seconds * per_step}


class PendingMasks:
    def __init__(self, future: Future, timings: GrammarTimings):
        self._future, self._timings = future, timings

    def result(self, device: torch.device) -> GrammarMasks:
        start = time.perf_counter()
        masks, seconds = self._future.result()
        self._timings.wait_seconds += time.perf_counter() - start
        self._timings.mask_seconds += seconds
        self._timings.steps += 1
        return GrammarMasks(masks.to(device, non_blocking=True))


class MaskFiller:
    """One per runner: a worker thread and llguidance's executor."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.timings = GrammarTimings()
        self._executor: llguidance.LLExecutor | None = None  # both made on the first request with a grammar
        self._pool: ThreadPoolExecutor | None = None

    def start(self, jobs: list[tuple[GrammarState, int, list[int]]], num_rows: int) -> PendingMasks | None:
        """``jobs``: (grammar position, first logits row, drafts) of each request with a grammar, whose
        rows are ``first .. first + len(drafts)``; ``num_rows``: the step's logits rows. None: no job."""
        if not jobs:
            return None
        if self._pool is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="eyas-grammar")
        return PendingMasks(self._pool.submit(self._fill, jobs, num_rows), self.timings)

    def _fill(self, jobs: list[tuple[GrammarState, int, list[int]]], num_rows: int) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        bitmask = torch.zeros(num_rows, self.words, dtype=torch.int32)  # [N, W]
        plain = [(state.matcher, first) for state, first, drafts in jobs if not drafts]
        drafting = [(state.matcher, first, drafts) for state, first, drafts in jobs if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), self.words * 4, num_rows)
        if drafting:  # rows first .. first + len(drafts): after each draft prefix (the matcher is restored)
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafting, bitmask.data_ptr(), self.words * 4,
                                                                   num_rows)
        for state, first, drafts in jobs:
            if state.tokens_left - len(drafts) <= HORIZON:
                self._close(state, first, drafts, bitmask)
        rows = torch.tensor([first + j for _, first, drafts in jobs for j in range(len(drafts) + 1)])  # [G]
        grammar_allowed = allowed_tokens(bitmask[rows], self.vocab_size)  # [G, V]
        ended = ~grammar_allowed.any(dim=-1)  # rows past an end-of-sequence draft
        eos = torch.tensor(sorted(jobs[0][0].eos_token_ids), dtype=torch.int64)
        grammar_allowed[ended.nonzero()[:, :1], eos] = True
        allowed = torch.ones(num_rows, self.vocab_size, dtype=torch.bool)  # [N, V]
        allowed[rows] = grammar_allowed
        return allowed, time.perf_counter() - start

    def _close(self, state: GrammarState, first: int, drafts: list[int], bitmask: torch.Tensor) -> None:
        """The rows where the budget-aware close binds allow its token only (``GrammarState.closing_token``)."""
        walk = state
        for j in range(len(drafts) + 1):
            closing = walk.closing_token()
            if closing is not None:
                bitmask[first + j] = torch.from_numpy(one_token_mask(closing, self.words).view(np.int32))
            if j == len(drafts) or drafts[j] in state.eos_token_ids:
                return
            walk = state.fork([]) if walk is state else walk
            walk.advance(drafts[j])
