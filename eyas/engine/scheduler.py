"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step the scheduler hands out a token budget: running requests first, then the drafts
worth verifying (``eyas.spec.adaptive``), then waiting requests, whose prompts are cut into
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
from eyas.kv.manager import KVCacheManager
from eyas.spec.adaptive import FREE_ROWS, DraftBudget, RowCost, allocate_drafts

if TYPE_CHECKING:
    from eyas.spec.config import SpeculativeConfig


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculative: "SpeculativeConfig | None" = None,
                 draft_row_cost: RowCost = FREE_ROWS, draft_step_cost: float = 0.0):
        self.config = config
        self.kv = kv
        self.speculative = speculative
        self.draft_row_cost = draft_row_cost  # a forward's cost by its rows, in one-row forwards
        self.draft_step_cost = draft_step_cost  # the drafter's work in a step that verifies drafts, likewise
        self.num_lookahead_tokens = speculative.max_drafts if speculative else 0
        self.budgets: dict[str, DraftBudget] = {}  # request id -> adaptive draft length
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.drafts: dict[str, list[int]] = {}  # request id -> draft tokens to verify next step
        self.forced: dict[str, list[bool]] = {}  # request id -> per draft: forced by its grammar
        self.spec_stats = SpecStats()  # engine-wide acceptance totals
        # block tables of requests that finished normally this step: their blocks are free again but
        # keep their contents until the next forward, so the engine can hand them to the runner
        self.finished_tables: dict[str, list[list[int]]] = {}

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
            request_drafts, request_forced = drafts.get(request.request_id, ([], []))
            lookahead = self.num_lookahead_tokens if will_sample else 0
            total = request.num_computed_tokens + num_new + len(request_drafts) + lookahead
            while not self.kv.allocate(request.request_id, total):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                scheduled = [s for s in scheduled if s.request is not victim]
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(self._entry(request, num_new, request_drafts, request_forced))
            budget -= num_new
            num_drafts += len(request_drafts)
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
            lookahead = self.num_lookahead_tokens if will_sample else 0
            if not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new + lookahead):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._entry(request, num_new, [], []))
            budget -= num_new
        num_tokens = sum(s.num_new_tokens + len(s.draft_token_ids) for s in scheduled)
        return SchedulerOutput(scheduled, num_tokens, preempted, self._expected_drafts(scheduled))

    def _plan_drafts(self, budget: int) -> dict[str, tuple[list[int], list[bool]]]:
        """The drafts each decoding request verifies this step (and their forced flags): those its adaptive
        limit, max_tokens and max_model_len allow, then, across the batch, those worth their rows
        (``allocate_drafts``), within the token budget that every running request's committed tokens leave."""
        if self.speculative is None:
            return {}
        sampling, num_rows, budget = self._rows(lambda r: r.num_tokens - r.num_computed_tokens, budget)
        offered = {request.request_id: self._usable_drafts(request) for request in sampling}
        if self.speculative.adaptive_draft_length:
            offers = [(len(d), self.budgets[i].acceptance(), _leading(f)) for i, (d, f) in offered.items()]
            counts = allocate_drafts(offers, num_rows, self.draft_row_cost, budget, self.draft_step_cost)
        else:  # every draft, first come first served within the budget
            counts = allocate_drafts([(len(d), 1.0, 0) for d, _ in offered.values()], num_rows, FREE_ROWS, budget)
        return {i: (d[:n], f[:n]) for (i, (d, f)), n in zip(offered.items(), counts)}

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
        """Per request sampling this step: the drafts the next step's ``_plan_drafts`` would verify for it, if
        its proposer offered every draft it may and this step's verification taught the budgets nothing.

        A pure peek (``DraftBudget.peek``, then ``allocate_drafts`` over the rows the next step will have: one
        per request sampling now, the rest of each unfinished prompt); what the next step really verifies can
        differ only through this step's acceptance, stops and admissions. Without adaptive drafting: k.
        """
        if self.speculative is None:
            return {}
        now = {entry.request.request_id: entry for entry in scheduled}
        drafting = {i for i, entry in now.items() if entry.will_sample}
        if not self.speculative.adaptive_draft_length:
            return dict.fromkeys(drafting, self.num_lookahead_tokens)

        def left(request: Request) -> int:  # tokens to compute next step
            entry = now.get(request.request_id)
            if entry is None:
                return request.num_tokens - request.num_computed_tokens
            return 1 if entry.will_sample else request.num_tokens - entry.start - entry.num_new_tokens

        sampling, num_rows, budget = self._rows(left, self.config.max_num_batched_tokens)
        offers = {}  # request id -> (drafts it may offer, acceptance, forced drafts: unknown yet)
        for request in sampling:  # a request whose prompt ends next step holds no drafts: it offers none
            fresh = DraftBudget.start(self.num_lookahead_tokens)
            limit, acceptance = self.budgets.get(request.request_id, fresh).peek()
            room = min(limit, self._room(request, 1)) if request.request_id in drafting and request.params.speculate else 0
            offers[request.request_id] = (max(0, room), acceptance, 0)
        counts = allocate_drafts(list(offers.values()), num_rows, self.draft_row_cost, budget, self.draft_step_cost)
        allocated = dict(zip(offers, counts))
        return {i: allocated.get(i, 0) for i in drafting}

    @staticmethod
    def _room(request: Request, new_tokens: int) -> int:
        """Drafts that fit max_model_len and max_tokens once the request holds ``new_tokens`` more tokens."""
        return min(request.max_total_tokens - request.num_tokens - new_tokens - 1,
                   request.max_output_tokens - request.num_output_tokens - new_tokens - 1)

    def _usable_drafts(self, request: Request) -> tuple[list[int], list[bool]]:
        """The pending drafts that fit the adaptive limit (which leading forced drafts pass: they are always
        accepted), max_model_len and max_tokens."""
        drafts = self.drafts.pop(request.request_id, [])
        forced = self.forced.pop(request.request_id, [False] * len(drafts))
        room = self._room(request, 0)
        if self.speculative.adaptive_draft_length:
            k = self.speculative.max_drafts
            limit = self.budgets.setdefault(request.request_id, DraftBudget.start(k)).limit
            room = min(room, max(limit, _leading(forced)))
        room = max(0, room)
        return drafts[:room], forced[:room]

    def _entry(self, request: Request, num_new: int, drafts: list[int], forced: list[bool]) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new, drafts, self.kv.block_tables(request.request_id),
                                will_sample=start + num_new == request.num_tokens, draft_forced=forced)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it for recompute. Its tokens stay, and so does its grammar
        position (it follows the committed tokens, not the cache); its pending drafts are dropped."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        self.drafts.pop(request.request_id, None)
        self.forced.pop(request.request_id, None)
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
            if request.request_id in self.budgets:  # the proposer's own record: leading forced drafts left out
                lead = min(_leading(entry.draft_forced), num_accepted)
                self.budgets[request.request_id].update(num_drafts - lead, num_accepted - lead)
            self.spec_stats.record(num_drafts, num_accepted, entry.draft_forced)
            if request.first_token_time is None:
                request.first_token_time = now
            for j, token in enumerate(emitted):
                request.token_ids.append(token)
                request.drafted.append(j < num_accepted)
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
                    self.drafts[request.request_id] = drafts
                    self.forced[request.request_id] = result.forced[request.request_id]
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

    def _finish(self, request: Request, now: float) -> None:
        if request in self.running:
            self.running.remove(request)
        request.finish_time = now
        tables = self.kv.free(request.request_id)
        if tables is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            self.finished_tables[request.request_id] = tables
        self.drafts.pop(request.request_id, None)
        self.forced.pop(request.request_id, None)
        self.budgets.pop(request.request_id, None)
        del self.requests[request.request_id]


def _leading(forced: list[bool]) -> int:
    """How many drafts at the front are forced by the grammar (certain to be accepted)."""
    n = 0
    while n < len(forced) and forced[n]:
        n += 1
    return n
