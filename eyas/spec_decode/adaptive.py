"""Adaptive drafting: per request, speculate as far as recent acceptance says it pays; per batch,
verify only the drafts whose expected tokens cover the rows they add.

Verifying a rejected draft is not free: on a CPU the target forward is compute-bound, so every
extra token costs time. Per request, the scheduler keeps one ``DraftBudget``:

* all drafts accepted -> the limit grows by 2 (up to k), like HF's assisted-generation schedule;
* fewer than half accepted -> the limit shrinks by 1 (not below 1); half or more -> it stays
  (on copy-heavy text a draft that breaks off midway is usually followed by a long one: on the
  benchmark's copy prompts at k = 8, shrinking on every rejection took 125 target forwards for
  344 tokens, this rule 117).

Example (k = 4): accepted 4/4 -> limit 4; 2/4 -> 4; 1/4 -> 3; 0/3 -> 2; 0/2 -> 1; 1/1 -> 3.

The budget also estimates ``acceptance()``, the chance that a draft is accepted once the one
before it was (a geometric model): decayed accepted drafts over accepted drafts plus decayed
rejections, with a prior of 0.5 weighted as 2 drafts. Evidence fades by 0.9 at every step the
request samples, whether it verified drafts or not, so the estimate of a request that stopped
verifying drifts back toward the prior. Draft j of a request with acceptance a is then worth a^j
expected tokens.

**Misses come in runs.** After a verification that accepts nothing the next one is likelier to accept
nothing too, by how much depending on the proposer and the text. So the budget keeps two estimates (``Evidence``):
one from the verifications made after a verification that accepted a draft (or before any), one from
those made after a verification that accepted none, and prices the next drafts with the one of the
state the request is in. Measured with every draft verified (greedy, batch 1, the default model): the
shipped EAGLE-3 drafter at k = 1 had its draft accepted 56% of the time after an accepted one and 39%
after a rejected one (16 held-out chat prompts), so a miss barely changes what its next draft is worth; suffix decoding on chat
prompts at k = 8 accepted some draft after a hit 77% of the time and after a miss 21% (17% after two),
so after a miss its drafts are worth a quarter as much. The rule this replaced paused a request for
2^n - 1 steps after n misses in a row; with it (and the straight-line row cost below) the EAGLE-3
drafter drafted in about 30% of batch-1 steps and ran 5-15% slower than with every draft verified.
Now it drafts in about 78% as many steps as with every draft verified, and runs level with it (16
prompts, 4 interleaved repeats, 2 threads: 1.05x plain against 1.05x).

Per batch (``allocate_drafts``): a forward of n rows costs ``cost(n)`` (``RowCost``: on a CPU the curve
measured for the target's products on this machine, ``eyas/runner/row_cost.py``; a user's
``SpeculativeConfig.draft_row_cost`` c makes it the line ``1 + c * n``), plus its attention (on a CPU, per key of
each request's context: once for its committed row, and again at a lower rate for each draft row), plus s when it
verifies any draft the
drafter made (s = the drafter's step cost, ``DraftCost``, by how many requests it drafts for and how deep: what a
drafter that leaves out the requests told 0 spends on a step it drafts in; 0 for cheap proposers;
``SpeculativeConfig.draft_step_cost`` makes it flat), and a step emits E tokens, one
per sampling request plus the expected accepted drafts. Drafts are ranked best first, and the step verifies
the prefix of that ranking with the highest E / cost (the longer on a tie; s counts as soon as the prefix holds a
draft the drafter made, and grows with the requests it drafts for, so its drafts are kept only if they beat the step
without them). On a line a draft
worth g tokens raises E / cost iff ``g * (1 + c * n + s) >= c * E``, and the best prefix is where that first
fails. The measured CPU curves bend the other way at a register tile's edge: on the GGUF curve a 5th row costs
0.60 of a forward where the 4th cost 0.12. One request at acceptance 0.95 offering 8 drafts: the 4th, worth
0.81, does not cover that jump (0.81 * 1.47 < 3.71 * 0.60), so a rule that stops at the first draft that does
not pay verifies 3 (3.71 tokens for 1.47, 2.52 a forward), where all 8 give 7.40 tokens for 2.70 (2.74); at
0.90, 3 is best (2.34 against 2.27). Replaying bench_spec's batch-1 workloads exactly on that curve
(``benchmarks/replay_drafting.py``: the plain outputs fixed, each step's drafts and acceptance recomputed),
the best prefix emitted 4.4-4.5% more tokens per forward on copy prompts (n-gram and suffix) and 2% more for
suffix decoding on code, and left chat level. With c = s = 0 (CUDA, where a few more rows cost nothing) every
offered draft is verified. Examples on the line (c = 0.05, s = 0): one request with acceptance 0.85 verifies
all 8 drafts (the 8th is worth 0.27 >= 0.17), while 8 requests with acceptance 0.5 verify one draft each (the
first is worth 0.5 >= 0.29; then a second, worth 0.25, falls short of 0.33). With c = 0.07 and s = 0.35 (k =
1) one request at acceptance 0.5 drafts (1.5 tokens for 1.49 beat 1 for 1.07), at 0.36 it does not (1.36 /
1.49 < 1 / 1.07); 14 requests at 0.5 would take a draft each, but 21 tokens for 3.31 fall short of 14 for
1.98, so none drafts. On the GGUF curve with the hidden-state drafters' s = 0.11 + 0.18 = 0.29 for one draft,
one request drafts one token from an acceptance of 0.41 (1.41 tokens for 1.12 + 0.29), where the line fitted to
the same curve (c = 0.25) wanted 0.48 with s = 0.35 (attention per key left out of these examples). Leading drafts
forced by the request's grammar (``eyas.sampling.grammar``) are certain, worth 1 each, and need no drafter (no s);
the drafts after them are worth a, a^2, ...

**Retrying.** A request the cost model gives no drafts verifies nothing, so its budget learns
nothing; the fade lets its estimate drift toward the prior, and it is verified again as soon as its
first draft is worth its row: once the estimate has drifted far enough, or once the batch makes rows
cheaper (prompt chunks in the forward, fewer requests). Example
(c = 0.07, s = 0, 8 decoding rows: a first draft must be worth 0.36): a request with 1 accepted
draft and 4 rejections, estimate (1 + 1) / (1 + 4 + 2) = 0.29, gets none; its evidence fades 0.9 a
step: after 5 steps (0.59 + 1) / (0.59 + 2.36 + 2) = 0.32, after 10 steps
(0.35 + 1) / (0.35 + 1.39 + 2) = 0.36, and its first draft is verified again. A request whose drafts
are never accepted is retried as often as the fade allows: a first draft that must be worth w passes
while its estimate after misses, 1 / (2 + r), has r <= 1 / w - 2 faded rejections, and those fade
0.1 r a step. At c = 0.1 with 2 decoding requests (w = 1/6, r <= 4) that is about 0.4 one-draft
retries a step, 4% of a forward: the price of noticing when the text turns predictable.

**Skipping the drafter.** After verification the runner asks the proposer for the next step's
drafts, so a drafter costs a step even when the scheduler will drop what it drafts. The scheduler
therefore tells the proposer, per sampling request, how many drafts it expects to verify next step
(``Scheduler._expected_drafts``): ``peek`` (the limit, and the estimate after this step's fade) and
``allocate_drafts`` over the rows the next step will have, side-effect free, as if this step's
verification brought no evidence. A proposer may skip a request told 0 (a hidden-state
drafter then leaves it out entirely, ``eyas.spec_decode.catch_up``). A skipped request is not starved: its
expectation comes from its budget alone, never from the drafts it holds, so a request skipped this
step is offered its full limit again at the next; a request the cost model rejects is retried as
above. Such a drafter runs its prefill, the step it drafts for a request, over the rows it left out
(``DraftCost.catch_up``: a prompt's chunks, the steps it was told 0) and that step's rows: for a request whose
prompt ends that step, a prefill over all of it. The expectation charges that once, spread over the tokens the
request may still make (as many as the engine's recent replies that stopped made past its length, within its
``max_tokens``: ``ReplyLengths``), as an entry cost of its first drafter-made draft (``allocate_drafts``'s ``entries``,
``DraftPlanner.expected``), and tells such a request to draft only if drafting also pays in a step of decodes
alone. Example (the shipped EAGLE-3 drafter, one Zen 4 thread, products of 1,900 rows about 62 one-row
forwards): 7 tool prompts of about 260 tokens end in one step, and the next step carries the 8th prompt's last 243
rows, beside which 7 draft rows look free; but in a step of 8 decodes drafting does not pay, so none is told to
draft, and the drafter's prefill over their 1,800 prompt rows is not paid for one verification. Alone, a request
with 96 tokens to make and a 260-token prompt enters at 8.4 / 96 = 0.09 forwards a step and drafts. Where the
recent replies made about 56, it enters at 8.4 / 56 = 0.15. Measured (``bench_tools.py``, tool_choice "auto", B =
1, one Zen 4 thread): priced over ``max_tokens``, the drafter's prefill ran at the end of each of the 8 prompts,
15-30 ms apiece, to save about 1 ms in each of about 13 drafting steps a reply; priced over the recent replies, it
ran for 2 of them.
Where even
the prior does not pay (decoding rows only, k = 1: from 15 requests with c = 0.07 and s = 0, from
5 with s = 0.35), no request drafts until the batch changes: the cost model's answer, not
starvation.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

PRIOR, PRIOR_WEIGHT = 0.5, 2.0  # acceptance before any evidence, and its weight in drafts
DECAY = 0.9  # per sampling step: older evidence fades


@dataclass
class Evidence:
    """Decayed verifications of one state of a request: accepted drafts, and verifications that rejected one."""

    accepted: float = 0.0
    rejections: float = 0.0

    def estimate(self, fade: float = 1.0) -> float:
        """P(a draft is accepted | the draft before it was), with this evidence faded by ``fade``."""
        accepted, rejections = fade * self.accepted, fade * self.rejections
        return (accepted + PRIOR * PRIOR_WEIGHT) / (accepted + rejections + PRIOR_WEIGHT)


@dataclass
class DraftBudget:
    k: int
    limit: int  # drafts the next step may verify
    missed: bool = False  # the last verification accepted none of its drafts
    after_hit: Evidence = field(default_factory=Evidence)  # verifications made after one that accepted (or first)
    after_miss: Evidence = field(default_factory=Evidence)  # verifications made after one that accepted none

    @classmethod
    def start(cls, k: int) -> "DraftBudget":
        return cls(k=k, limit=k)

    def _state(self) -> Evidence:
        return self.after_miss if self.missed else self.after_hit

    def acceptance(self) -> float:
        """P(a draft is accepted | the draft before it was) in the request's state, from recent verifications."""
        return self._state().estimate()

    def peek(self) -> tuple[int, float]:
        """(``limit``, ``acceptance()`` after this step's fade) if this step's verification adds no evidence."""
        return self.limit, self._state().estimate(DECAY)

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """One sampling step of the request: evidence fades, then ``num_drafts`` verified drafts count (0: none)."""
        for evidence in (self.after_hit, self.after_miss):
            evidence.accepted *= DECAY
            evidence.rejections *= DECAY
        if num_drafts == 0:
            return
        state = self._state()
        state.accepted += num_accepted
        state.rejections += num_accepted < num_drafts
        if num_accepted == num_drafts:
            self.limit = min(self.k, self.limit + 2)
        elif 2 * num_accepted < num_drafts:
            self.limit = max(1, self.limit - 1)
        self.missed = num_accepted == 0


@dataclass(frozen=True)
class RowCost:
    """What a target forward of n rows costs: measured ``(rows, cost)`` points in one-row forwards, read along
    straight lines between them and along the last segment past the last one. ``linear(c)`` is ``1 + c * n``.

    Example (the GGUF kernels at "highest", AMD Zen 4, 2 threads): (1, 1.00), (2, 1.10), (3, 1.22), (4, 1.38), (5, 1.76)
    ...: up to 4 rows share a register tile, so a 2-row verification costs 1.10 forwards, not the 1.16 of the
    straight line fitted over 1..16 rows (c = 0.19), and a 5th row costs 0.38.

    The points are the matrix products'. Attention grows with the keys a row reads, so a request of context L adds
    ``first_key * L`` for the row of its committed token and ``per_key * L`` for each draft row
    (``attention(context, rows)``): on the default model, one Zen 4 thread, a draft row at 400 keys adds about 0.1
    one-row forwards of attention and one at 4,000 keys 1.0, where its products cost 0.17. ``linear(c)`` leaves
    them out (a user's line)."""

    points: tuple[tuple[int, float], ...]  # rows ascending, at least two
    first_key: float = 0.0  # a request's committed row, per key of its context (its K/V read once a step)
    per_key: float = 0.0  # each further row of the request (a draft), per key: the arithmetic of another query

    def attention(self, context: int, rows: int) -> float:
        """The attention of a request of ``context`` keys with ``rows`` rows (its committed token, then drafts)."""
        return context * (self.first_key + self.per_key * (rows - 1)) if rows else 0.0

    @classmethod
    def linear(cls, c: float) -> "RowCost":
        return cls(((0, 1.0), (1, 1.0 + c)))

    @functools.cached_property
    def _rows(self) -> tuple[int, ...]:
        return tuple(n for n, _ in self.points)

    def __call__(self, rows: int) -> float:
        # the segment ending at the first point at or past rows; past the last point, the last segment extended
        end = min(bisect.bisect_left(self._rows, rows, 1), len(self.points) - 1)
        (n0, c0), (n1, c1) = self.points[end - 1], self.points[end]
        return c0 + (c1 - c0) * (rows - n0) / (n1 - n0)


FREE_ROWS = RowCost.linear(0.0)  # rows that cost nothing (CUDA): every offered draft is verified


@dataclass(frozen=True)
class DraftCost:
    """What a drafter's work costs in a step that drafts, in one-row target forwards, by the number of requests it
    drafts for (r) and the most drafts one of them gets (d); ``s(0, d) = 0``: a drafter that leaves out the requests
    told 0 costs nothing when every request is (``eyas.spec_decode.catch_up``).

    ``base`` is what one pass of the drafter costs for one request, timed end to end at batch 1 (its forward, head,
    sampling, Python): a chain drafter makes d drafts in d passes (the draft prefill, then d - 1 decode steps), a
    parallel one in at most 2 (the prefill, then one forward of mask rows). ``fixed`` is what a step that drafts
    pays once, whatever the depth (the draft batch and the catch-up store, the grammar's walks, the draft prefill's
    setup), so s(1, d) = fixed + d base for a chain. ``products`` is the drafter's own matrix
    products by rows, in one-row target forwards, measured on this machine
    (``eyas.runner.row_cost.measured_draft_products``); more requests add their growth: a draft prefill of about 2
    rows a request (the verified token and an accepted draft), then for a chain drafter d - 1 decode passes of r
    rows, for a parallel one a single forward of (d - 1) r mask rows::

        s(r, d) = fixed + d base + P(2r) - P(2) + (d - 1) (P(r) - P(1))                    chain
        s(r, d) = fixed + (1 + [d > 1]) base + P(2r) - P(2) + P((d - 1) r) - P(d - 1)     parallel

    Without ``products`` (CUDA, a user's ``draft_step_cost``) s is ``base`` for any r > 0 and d > 0: a flat figure
    for a whole step. Example (the shipped EAGLE-3 drafter on one thread of an Emerald Rapids Xeon: base 0.15, P(1) =
    0.052, P(2) = 0.065, P(8) = 0.149, P(16) = 0.254): one request costs 0.15 at depth 1 and 0.45 at depth 3 (on a
    Zen 4 thread three passes took 3.5-3.7 ms beside a decode step of 8.4: 0.42-0.44), 8 requests at depth 1 cost
    0.15 + 0.254 - 0.065 = 0.34, at depth 3 another 2 (0.15 + 0.149 - 0.052) = 0.49. Until 2026-11-29 a chain's
    d - 1 decode passes were left out at one request (0.15 at any depth), and EAGLE-3 verified 3 drafts a step at
    batch 1 on the Zen 4 host, where they made it 0.97-1.00x (``benchmarks/README.md``); the flat 0.15 before that
    let it draft at batch 8 where its drafts did not pay. The figures since 2026-11-29 (``Speculator.step_cost``):
    base 0.18 and fixed 0.11, from a Zen 4 thread where a draft step took 1.72 ms at k = 1 and 3.46 at k = 3 with
    every draft verified (0.3 ms of it paid without drafting too), and the target's one-row products 4.86 ms; with
    base 0.15 alone a one-draft step was priced at 0.6 of what it took.
    """

    base: float = 0.0
    products: RowCost | None = None
    parallel: bool = False
    # the drafter leaves out the requests told 0 and, when it drafts for one again, first runs its prefill over the
    # rows it left out (eyas.spec_decode.catch_up): ``catch_up(rows)``
    catches_up: bool = False
    fixed: float = 0.0  # a step that drafts, once (with ``products`` only: a flat figure is all in ``base``)

    def catch_up(self, rows: int) -> float:
        """What a catch-up over ``rows`` costs: the drafter's products over them (its attention left out)."""
        return self.products(rows) if self.catches_up and self.products is not None and rows > 0 else 0.0

    def __call__(self, requests: int, depth: int) -> float:
        if requests == 0 or depth == 0:
            return 0.0
        if self.products is None:
            return self.base
        p = self.products
        if self.parallel:
            later = (depth > 1) * self.base + p((depth - 1) * requests) - p(depth - 1)
        else:
            later = (depth - 1) * (self.base + p(requests) - p(1))
        return self.fixed + self.base + (p(2 * requests) - p(2)) + later  # fixed + d base (chain) at one request


NO_DRAFT_COST = DraftCost()  # a proposer whose drafting is cheap, or that drafts whatever it is told


def allocate_drafts(offers: list[tuple[int, float, int]], num_rows: int, cost: RowCost,
                    max_drafts: int, step_cost: DraftCost = NO_DRAFT_COST, entries: list[float] | None = None,
                    contexts: list[int] | None = None) -> list[int]:
    """How many drafts each sampling request verifies this step (see the module docstring).

    ``offers[i]`` = (drafts request i may verify, its acceptance estimate, how many of them lead
    the chain forced by its grammar); ``num_rows``: the forward's rows without drafts; ``cost``: the
    forward's cost by its rows; ``max_drafts``: what the token budget
    leaves for drafts; ``step_cost``: the drafter's work, paid by a step that verifies drafts it made, by the
    requests it drafts for and their most drafts (forced drafts need none); ``entries[i]``: what request i's
    first draft made by the drafter costs on top (its share of a catch-up, ``DraftPlanner.expected``);
    ``contexts[i]``: the keys request i's rows attend to (``RowCost.attention``; None: none counted).
    """
    entries = entries or [0.0] * len(offers)
    contexts = contexts or [0] * len(offers)
    attention = sum(cost.attention(context, 1) for context in contexts)  # the committed rows'
    gains = sorted(((acceptance ** max(0, j - certain), j <= certain, i)
                    for i, (n, acceptance, certain) in enumerate(offers) for j in range(1, n + 1)),
                   key=lambda gain: -gain[0])[:max_drafts]  # stable: a request's drafts stay in order; forced first
    tokens = float(len(offers))
    made = [0] * len(offers)  # per request: drafts of the prefix that the drafter made
    requests = depth = 0
    entered = 0.0  # the entries of the requests the drafter drafts for
    best, take = tokens / (cost(num_rows) + attention), 0  # E / cost of the best prefix of ``gains``, and its length
    for m, (gain, certain, i) in enumerate(gains, start=1):
        tokens += gain
        attention += cost.per_key * contexts[i]
        if not certain:
            made[i] += 1
            requests += made[i] == 1
            entered += entries[i] if made[i] == 1 else 0.0
            depth = max(depth, made[i])
        rate = tokens / (cost(num_rows + m) + attention + step_cost(requests, depth) + entered)
        if rate >= best:
            best, take = rate, m
    counts = [0] * len(offers)
    for _, _, i in gains[:take]:
        counts[i] += 1
    return counts
