"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step the scheduler hands out a token budget: running requests first, then the drafts
worth verifying (``eyas.spec_decode.adaptive``), then waiting requests, whose prompts are cut into
chunks that fit what is left. A request samples only in the step whose chunk reaches its
last known token. When blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later (prompt and outputs so far), so outputs are unchanged. The plan also says
how many drafts each sampling request is expected to verify next step, so the proposer can
skip drafting the ones whose drafts would be dropped.

The scheduler alone mutates requests and, through the KV-cache manager, block tables.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from eyas.config import SchedulerConfig
from eyas.core.metrics import SpecStats
from eyas.core.request import Request, RequestStatus
from eyas.core.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from eyas.engine.draft_planner import NO_DRAFTS, DraftPlanner, Drafts
from eyas.kv.manager import KVCacheManager
from eyas.spec_decode.adaptive import FREE_ROWS, NO_DRAFT_COST, DraftCost, RowCost

if TYPE_CHECKING:
    from eyas.spec_decode.config import SpeculativeConfig


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculative: "SpeculativeConfig | None" = None,
                 draft_row_cost: RowCost = FREE_ROWS, draft_step_cost: DraftCost = NO_DRAFT_COST):
        self.config = config
        self.kv = kv
        self.speculative = speculative
        # every request's pending drafts and draft budget; None without speculation
        self.drafts = DraftPlanner(speculative.max_drafts, speculative.lookahead, speculative.adaptive_draft_length,
                                   draft_row_cost, draft_step_cost) if speculative else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()  # engine-wide acceptance totals
        # block tables of requests that finished normally this step: their blocks are free again but
        # keep their contents until the next forward, so the engine can hand them to the runner
        self.finished_tables: dict[str, list[list[int]]] = {}

    def _with_lookahead(self, request: Request, tokens: int, will_sample: bool) -> int:
        """``tokens`` cache slots and those a request keeps past them for the drafts it may verify next step: the
        proposer's most, more with a grammar that may force them (``DraftPlanner.lookahead``); none past
        max_model_len, where no draft goes."""
        if self.drafts is None or not will_sample:
            return tokens
        lookahead = self.drafts.lookahead if request.grammar is not None else self.drafts.max_drafts
        return max(tokens, min(tokens + lookahead, request.max_total_tokens))

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        drafts = self._plan_drafts(budget)
        num_drafts = 0
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            will_sample = num_new == request.num_tokens - request.num_computed_tokens
            request_drafts = drafts.get(request.request_id, NO_DRAFTS)
            total = self._with_lookahead(request, request.num_computed_tokens + num_new + len(request_drafts.tokens),
                                         will_sample)
            while not self.kv.allocate(request.request_id, total):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                scheduled = [s for s in scheduled if s.request is not victim]
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(self._entry(request, num_new, request_drafts))
            budget -= num_new
            num_drafts += len(request_drafts.tokens)
        budget -= num_drafts
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            if (request.num_computed_tokens == 0 and request.request_id not in self.kv.tables
                    and request.params.prompt_logprobs is None):  # prompt logprobs need every position computed
                cached = self.kv.lookup_prefix(request.request_id, request.token_ids)
                request.num_computed_tokens = cached
                if request.num_preemptions == 0:
                    request.num_cached_tokens = cached
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            will_sample = request.num_computed_tokens + num_new == request.num_tokens
            if not self.kv.allocate(request.request_id,
                                    self._with_lookahead(request, request.num_computed_tokens + num_new, will_sample)):
                # a waiting request holds no blocks: give back the cached prefix it took, or it starves the others
                self.kv.free(request.request_id)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._entry(request, num_new))
            budget -= num_new
        num_tokens = sum(s.num_new_tokens + len(s.draft_token_ids) for s in scheduled)
        return SchedulerOutput(scheduled, num_tokens, preempted, self._expected_drafts(scheduled))

    def _plan_drafts(self, budget: int) -> dict[str, Drafts]:
        """The drafts each decoding request verifies this step (``DraftPlanner.plan``), within the token budget
        that every running request's committed tokens leave."""
        if self.drafts is None:
            return {}
        sampling, num_rows, budget = self._rows(lambda r: r.num_tokens - r.num_computed_tokens, budget)
        return self.drafts.plan(sampling, num_rows, budget)

    def _rows(self, left, budget: int) -> tuple[list[Request], int, int]:
        """Walk the running requests as a step does, ``left(request)`` tokens still to compute each: (those that
        would sample, the rows without drafts, the token budget left for drafts)."""
        sampling, num_rows = [], 0
        for request in self.running:
            to_compute = left(request)
            num_new = min(to_compute, budget)
            if num_new <= 0:
                continue
            budget -= num_new
            num_rows += num_new
            if num_new == to_compute:
                sampling.append(request)
        return sampling, num_rows, budget

    def _expected_drafts(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """Per request sampling this step: the drafts the next step would verify for it (``DraftPlanner.expected``
        over the rows the next step will have: one per request sampling now, the rest of each unfinished prompt)."""
        if self.drafts is None:
            return {}
        now = {entry.request.request_id: entry for entry in scheduled}
        drafting = {i: entry.num_new_tokens - 1 for i, entry in now.items() if entry.will_sample}

        def left(request: Request) -> int:  # tokens to compute next step
            entry = now.get(request.request_id)
            if entry is None:
                return request.num_tokens - request.num_computed_tokens
            return 1 if entry.will_sample else request.num_tokens - entry.start - entry.num_new_tokens

        sampling, num_rows, budget = self._rows(left, self.config.max_num_batched_tokens)
        expected = self.drafts.expected(drafting, sampling, num_rows, budget)
        self.drafts.left_out(scheduled, expected)
        return expected

    def _entry(self, request: Request, num_new: int, drafts: Drafts = NO_DRAFTS) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new, drafts.tokens, self.kv.block_tables(request.request_id),
                                will_sample=start + num_new == request.num_tokens, draft_forced=drafts.forced,
                                draft_probs=drafts.probs)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it for recompute. Its tokens stay, and so does its grammar
        position (it follows the committed tokens, not the cache); its pending drafts are dropped."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        if self.drafts is not None:
            self.drafts.drop_drafts(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def commit(self, plan: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply one step: advance computed counts, append emitted tokens, check stops, keep drafts.

        ``result.sampled`` maps each sampling request to the tokens it emitted (accepted drafts
        plus one recovered or bonus token). The KV slots of rejected drafts are freed; the
        proposer's drafts are kept for the next step. Returns the requests that got tokens.
        """
        now = time.perf_counter()
        changed = []
        for entry in plan.scheduled:
            request = entry.request
            request.num_computed_tokens += entry.num_new_tokens
            if not entry.will_sample:
                self.kv.register_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
                continue
            emitted = result.sampled[request.request_id]
            num_accepted = len(emitted) - 1
            request.num_computed_tokens += num_accepted  # accepted drafts are in the cache already
            num_drafts = len(entry.draft_token_ids)
            request.spec_stats.record(num_drafts, num_accepted, entry.draft_forced)
            if self.drafts is not None:
                self.drafts.verified(request.request_id, num_drafts, num_accepted, entry.draft_forced)
            self.spec_stats.record(num_drafts, num_accepted, entry.draft_forced)
            if request.first_token_time is None:
                request.first_token_time = now
            for j, token in enumerate(emitted):
                request.token_ids.append(token)
                request.from_draft.append(j < num_accepted)
                if request.grammar is not None:
                    request.grammar.advance(token)
                if self._stop_reason(request, token) is not None:
                    request.status = self._stop_reason(request, token)
                    break
            self.kv.register_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            if request.status.finished:
                self._finish(request, now)
            else:
                self.kv.truncate(request.request_id, request.num_tokens)  # slots of rejected drafts
                drafts = result.drafts.get(request.request_id)
                if drafts and request.params.speculate:
                    self.drafts.keep(request.request_id, drafts, result.forced[request.request_id],
                                     result.draft_probs.get(request.request_id))
            changed.append(request)
        return changed

    def _stop_reason(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.grammar is not None and token in request.grammar.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: min_tokens and ignore_eos yield
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish from outside the step (abort, or a stop string found in the text)."""
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return None
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._finish(request, time.perf_counter())
        return request

    def stop_string(self, request: Request, num_output_tokens: int) -> None:
        """A stop string in the text ended ``request`` at its first ``num_output_tokens`` outputs: the tokens a
        verification committed after them go, and it finishes stopped, also where this step's commit ended it
        past the stop string (at max_tokens, or an end-of-sequence draft), as decoding a token a step would have."""
        del request.token_ids[request.num_prompt_tokens + num_output_tokens:]
        del request.from_draft[num_output_tokens:]
        if request.status.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request, now: float) -> None:
        if request in self.running:
            self.running.remove(request)
        request.finish_time = now
        tables = self.kv.free(request.request_id)
        if tables is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            self.finished_tables[request.request_id] = tables
        if self.drafts is not None:
            self.drafts.done(request)
        del self.requests[request.request_id]

