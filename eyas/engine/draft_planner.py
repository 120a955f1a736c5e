"""Each request's speculation between steps, in one record, and the choice of which drafts a step verifies.

The scheduler owns the planner: it keeps the drafts the proposer made for a request (with their grammar-forced
flags and the drafter's probabilities, which it passes back to the runner untouched), the request's adaptive
draft budget (``eyas.spec_decode.adaptive``), and decides, across a batch, how many of each request's drafts are worth
their rows this step (``plan``) and how many the next step is expected to verify (``expected``, which a drafter
reads to skip the requests whose drafts would be dropped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from eyas.core.request import Request, RequestStatus
from eyas.spec_decode.adaptive import FREE_ROWS, NO_DRAFT_COST, DraftBudget, DraftCost, RowCost, allocate_drafts


@dataclass
class DraftRecord:
    """One request's speculation state."""

    tokens: list[int] = field(default_factory=list)  # drafts proposed for the next step
    forced: list[bool] = field(default_factory=list)  # per draft: the only token its grammar admits there
    probs: Any = None  # [n, vocab] the drafter's probabilities of them (rejection sampling), a device tensor; or None
    budget: DraftBudget | None = None  # its adaptive draft length; None without adaptive drafting
    behind: int = 0  # committed tokens the drafter has left out since it last drafted for the request (catch_up)


@dataclass(frozen=True)
class Drafts:
    """What a request verifies this step."""

    tokens: list[int]
    forced: list[bool]
    probs: Any  # [len(tokens), vocab] or None


NO_DRAFTS = Drafts([], [], None)

RECENT_REPLIES = 64  # finished replies whose lengths say how long the next ones run


@dataclass
class ReplyLengths:
    """The output lengths of the engine's recent finished requests: how many tokens a running request may still
    make, to spread over them a cost paid once (a drafter's catch-up, ``DraftPlanner.expected``). ``max_tokens``
    only bounds a reply: tool calls and short answers end long before it. A reply cut by its own limit (None here)
    says only that it would have run on: it counts as running to the room of the request asking (a warm-up of 2
    tokens must not make every reply look short).

    Example: replies that stopped after 40, 60 and 200 tokens; a request that has made 50 tokens with room for 300
    more may make min(60 - 50, 300) and min(200 - 50, 300), 80 on average; one that has made 250, or any before a
    reply finished, its room. With a fourth reply cut at 20 tokens, the first request may make (10 + 150 + 300) / 3.
    """

    lengths: deque = field(default_factory=lambda: deque(maxlen=RECENT_REPLIES))

    def add(self, length: int | None) -> None:
        """A finished reply: the tokens it made where it stopped, None where its limit cut it."""
        self.lengths.append(length)

    def left(self, made: int, room: int) -> int:
        """Tokens a request that has made ``made`` may still make, at most ``room``: the mean of what the recent
        replies longer than ``made`` made past it (a cut one: ``room``), or ``room`` when none was longer."""
        past = [room if n is None else min(n - made, room) for n in self.lengths if n is None or n > made]
        return max(1, round(sum(past) / len(past))) if past else room


class DraftPlanner:
    def __init__(self, max_drafts: int, lookahead: int, adaptive: bool, row_cost: RowCost = FREE_ROWS,
                 step_cost: DraftCost = NO_DRAFT_COST):
        self.max_drafts = max_drafts  # the most drafts the proposer makes for a request (an adaptive budget's k)
        self.lookahead = lookahead  # the lookahead slots of a request with a grammar, which may force more drafts
        self.adaptive = adaptive
        self.row_cost = row_cost  # a forward's cost by its rows, in one-row forwards
        self.step_cost = step_cost  # the drafter's work in a step that verifies drafts, likewise
        self.records: dict[str, DraftRecord] = {}
        self.replies = ReplyLengths()

    def _record(self, request_id: str) -> DraftRecord:
        record = self.records.get(request_id)
        if record is None:
            record = self.records[request_id] = DraftRecord()
            if self.adaptive:
                record.budget = DraftBudget.start(self.max_drafts)
        return record

    def plan(self, sampling: list[Request], num_rows: int, budget: int) -> dict[str, Drafts]:
        """The drafts each request of ``sampling`` (those whose next token the step samples) verifies: those its
        adaptive limit, max_tokens and max_model_len allow, then, across the batch, those worth their rows
        (``allocate_drafts``) within the token ``budget`` the step's ``num_rows`` committed tokens leave. The
        pending drafts are taken: a request drafts anew after every verification."""
        offered = {request.request_id: self._usable(request) for request in sampling}
        if self.adaptive:
            offers = [(len(d.tokens), self.records[i].budget.acceptance(), _leading(d.forced))
                      for i, d in offered.items()]
            counts = allocate_drafts(offers, num_rows, self.row_cost, budget, self.step_cost,
                                     contexts=[request.num_tokens for request in sampling])
        else:  # every draft, first come first served within the budget
            counts = allocate_drafts([(len(d.tokens), 1.0, 0) for d in offered.values()], num_rows, FREE_ROWS, budget)
        return {i: _first(d, n) for (i, d), n in zip(offered.items(), counts)}

    def expected(self, drafting: dict[str, int], sampling: list[Request], num_rows: int, budget: int) -> dict[str, int]:
        """Per request of ``drafting`` (sampling this step; its value: the rows of its layout this step past the
        last one, a prompt chunk's): the drafts the next step's ``plan`` would verify for it, if its proposer
        offered every draft it may and this step's verification taught the budgets nothing.

        A pure peek (``DraftBudget.peek``, then ``allocate_drafts`` over the next step's ``sampling`` requests
        and ``num_rows``); what the next step really verifies can differ only through this step's acceptance,
        stops and admissions. Without adaptive drafting: every lookahead slot.

        A drafter that catches up (``DraftCost.catch_up``) runs its prefill, the step it drafts for a request, over
        the rows it left out (``behind``) and this step's rows; past the one row a decode brings, that is a cost
        paid once for the steps that follow. It enters as the request's share of it over the tokens it may still
        make (``ReplyLengths.left``: as many as the recent replies made past its own length, within its room),
        and such a request is told to draft only if drafting would also pay in a step of decodes alone: a
        next step that carries a long prompt chunk makes draft rows look free, but the steps after it do not.
        """
        if not self.adaptive:
            return dict.fromkeys(drafting, self.max_drafts)
        offers = {}  # request id -> (drafts it may offer, acceptance, forced drafts: unknown yet)
        entries = []  # per offer: its catch-up spread over the steps it may still take (one token each, at most)
        for request in sampling:  # a request whose prompt ends next step holds no drafts: it offers none
            record = self.records.get(request.request_id)
            limit, acceptance = (record.budget if record else DraftBudget.start(self.max_drafts)).peek()
            may = request.request_id in drafting and request.params.speculate
            offers[request.request_id] = (max(0, min(limit, room(request, 1))) if may else 0, acceptance, 0)
            rows = (record.behind if record else 0) + drafting.get(request.request_id, 0)
            catch_up = self.step_cost.catch_up(rows)  # 0 for a proposer that does not catch up: nothing to spread
            entries.append(catch_up / max(1, self.replies.left(request.num_output_tokens, room(request, 0)))
                           if catch_up else 0.0)
        contexts = [request.num_tokens + 1 for request in sampling]  # after this step's token
        counts = allocate_drafts(list(offers.values()), num_rows, self.row_cost, budget, self.step_cost, entries,
                                 contexts)
        if any(entries):
            decodes = allocate_drafts(list(offers.values()), len(offers), self.row_cost, budget, self.step_cost,
                                      entries, contexts)
            counts = [n if not entry or steady else 0 for n, entry, steady in zip(counts, entries, decodes)]
        allocated = dict(zip(offers, counts))
        return {i: allocated.get(i, 0) for i in drafting}

    def left_out(self, scheduled: list, expected: dict[str, int]) -> None:
        """After ``expected`` told the drafter which requests to draft for this step: those it drafts for are
        caught up; every other scheduled request falls behind by the committed tokens it computes (a prompt
        chunk, or its last token; the drafts it verifies may be rejected). Counted only for a drafter that
        catches up (``DraftCost.catches_up``): for any other, ``behind`` prices nothing."""
        if not self.step_cost.catches_up:
            return
        for entry in scheduled:
            record = self._record(entry.request.request_id)
            told = expected.get(entry.request.request_id, 0)
            record.behind = 0 if told else record.behind + entry.num_new_tokens

    def verified(self, request_id: str, num_drafts: int, num_accepted: int, forced: list[bool]) -> None:
        """A verification's outcome teaches the request's budget (leading forced drafts left out: they are
        always accepted, whatever the proposer is worth)."""
        record = self.records.get(request_id)
        if record is not None and record.budget is not None:
            lead = min(_leading(forced), num_accepted)
            record.budget.update(num_drafts - lead, num_accepted - lead)

    def keep(self, request_id: str, tokens: list[int], forced: list[bool], probs: Any) -> None:
        """The proposer's drafts for the request's next step."""
        record = self._record(request_id)
        record.tokens, record.forced, record.probs = tokens, forced, probs

    def drop_drafts(self, request_id: str) -> None:
        """Preemption: the pending drafts go (the request is recomputed); its budget stays."""
        record = self.records.get(request_id)
        if record is not None:
            record.tokens, record.forced, record.probs = [], [], None
            record.behind = 0  # counted again over the recomputed tokens

    def done(self, request: Request) -> None:
        """The request left the engine; how long its reply ran is kept (``ReplyLengths``) unless it was aborted."""
        self.records.pop(request.request_id, None)
        if request.status is RequestStatus.FINISHED_STOPPED:
            self.replies.add(request.num_output_tokens)
        elif request.status is RequestStatus.FINISHED_LENGTH:
            self.replies.add(None)

    def _usable(self, request: Request) -> Drafts:
        """The pending drafts that fit the adaptive limit (which leading forced drafts pass), max_model_len and
        max_tokens, taken from the record."""
        record = self._record(request.request_id)
        drafts = Drafts(record.tokens, record.forced or [False] * len(record.tokens), record.probs)
        record.tokens, record.forced, record.probs = [], [], None
        limit = room(request, 0)
        if record.budget is not None:
            limit = min(limit, max(record.budget.limit, _leading(drafts.forced)))
        return _first(drafts, max(0, limit))


def room(request: Request, new_tokens: int) -> int:
    """Drafts that fit max_model_len and max_tokens once the request holds ``new_tokens`` more tokens."""
    return min(request.max_total_tokens - request.num_tokens - new_tokens - 1,
               request.max_output_tokens - request.num_output_tokens - new_tokens - 1)


def _first(drafts: Drafts, n: int) -> Drafts:
    if n >= len(drafts.tokens):
        return drafts
    return Drafts(drafts.tokens[:n], drafts.forced[:n], None if drafts.probs is None else drafts.probs[:n])


def _leading(forced: list[bool]) -> int:
    """How many drafts at the front are forced by the grammar (certain to be accepted)."""
    n = 0
    while n < len(forced) and forced[n]:
        n += 1
    return n
