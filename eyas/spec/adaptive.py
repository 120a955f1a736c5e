"""Adaptive drafting: per request, speculate as far as recent acceptance says it pays; per batch,
verify only the drafts whose expected tokens cover the rows they add.

Verifying a rejected draft is not free: on a CPU the target forward is compute-bound, so every
extra token costs time. Per request, the scheduler keeps one ``DraftBudget``:

* all drafts accepted -> the limit grows by 2 (up to k), like HF's assisted-generation schedule;
* fewer than half accepted -> the limit shrinks by 1 (not below 1); half or more -> it stays
  (on copy-heavy text a draft that breaks off midway is usually followed by a long one: on the
  benchmark's copy prompts at k = 8, shrinking on every rejection took 125 target forwards for
  344 tokens, this rule 117);
* none accepted n times in a row -> drafting pauses for 2^n - 1 steps (at most 31), so a
  request whose text the drafter cannot predict (chat with the n-gram matcher) falls back to
  plain decoding, and tries again now and then.

Example (k = 4): accepted 4/4 -> limit 4; 2/4 -> 4; 1/4 -> 3; 0/3 -> 2 and a 1-step pause; 0/2
-> 1 and a 3-step pause; 1/1 -> limit 3, pauses reset.

The budget also estimates ``acceptance()``, the chance that a draft is accepted once the one
before it was (a geometric model): decayed accepted drafts over accepted drafts plus decayed
rejections, with a prior of 0.5 weighted as 2 drafts. Evidence fades by 0.9 at every step the
request samples, whether it verified drafts or not, so the estimate of a request that stopped
verifying drifts back toward the prior. Draft j of a request with acceptance a is then worth a^j
expected tokens.

Per batch (``allocate_drafts``): a forward of n rows costs ``1 + c * n`` (c = the row cost,
``SpeculativeConfig.draft_row_cost``), plus s when it verifies any draft the drafter made (s = the
drafter's step cost, ``SpeculativeConfig.draft_step_cost``: what a drafter that leaves out the
requests told 0 spends on a step it drafts in; 0 for cheap proposers), and a step emits E tokens,
one per sampling request plus the expected accepted drafts. A draft worth g tokens raises
E / cost iff ``g * (1 + c * n + s) >= c * E``; drafts are taken best first while that holds, and
the drafter's drafts are kept only if E / cost then beats the step without them. With c = s = 0
(CUDA, where a few more rows cost nothing) every offered draft is verified. Examples (c = 0.05,
s = 0): one request with acceptance 0.85 verifies all 8 drafts (the 8th is worth 0.27 >= 0.17),
while 8 requests with acceptance 0.5 verify one draft each (the first is worth 0.5 >= 0.29; then a
second, worth 0.25, falls short of 0.33). The CPU defaults are c = 0.07 for float32 weights, 0.21 for
bf16, 0.34 for int8 and 0.25 for GGUF formats (``eyas.spec.config.CPU_ROW_COSTS``) and, for hidden-state
drafters, s = 0.35. With c = 0.07 (k = 1) one request at acceptance 0.5 drafts (1.5 tokens for 1.49
beat 1 for 1.07), at 0.36 it does not (1.36 / 1.49 < 1 / 1.07); 14 requests at 0.5 would take a
draft each, but 21 tokens for 3.31 fall short of 14 for 1.98, so none drafts. Leading drafts forced
by the request's grammar (``eyas.sampling.grammar``) are certain, worth 1 each, and need no drafter
(no s); the drafts after them are worth a, a^2, ...

**Retrying.** A request the cost model gives no drafts verifies nothing, so its budget learns
nothing; the fade lets its estimate drift toward the prior, and it is verified again as soon as its
first draft is worth its row: once the estimate has drifted far enough, or once the batch makes rows
cheaper (prompt chunks in the forward, fewer requests). A pause, too, ends with an estimate closer
to the prior, so the retry it promises is not refused for the misses that caused it. Example
(c = 0.07, s = 0, 8 decoding rows: a first draft must be worth 0.36): a request with 1 accepted
draft and 4 rejections, estimate (1 + 1) / (1 + 4 + 2) = 0.29, gets none; its evidence fades 0.9 a
step: after 5 steps (0.59 + 1) / (0.59 + 2.36 + 2) = 0.32, after 10 steps
(0.35 + 1) / (0.35 + 1.39 + 2) = 0.36, and its first draft is verified again.

**Skipping the drafter.** After verification the runner asks the proposer for the next step's
drafts, so a drafter costs a step even when the scheduler will drop what it drafts. The scheduler
therefore tells the proposer, per sampling request, how many drafts it expects to verify next step
(``Scheduler._expected_drafts``): ``peek`` (what the next ``take`` gives, and the estimate after this
step's fade) and ``allocate_drafts`` over the rows the next step will have, side-effect free, as if
this step's verification brought no evidence. A proposer may skip a request told 0 (a hidden-state
drafter then leaves it out entirely, ``eyas.spec.catch_up``). A skipped request is not starved: its
expectation comes from its budget alone, never from the drafts it holds, so a request skipped this
step is offered its full limit again at the next; a pause counts down every step, drafted or not,
and drafting resumes when it ends; a request the cost model rejects is retried as above. Where even
the prior does not pay (decoding rows only, k = 1: from 15 requests with c = 0.07 and s = 0, from
5 with s = 0.35), no request drafts until the batch changes: the cost model's answer, not
starvation.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 31
PRIOR, PRIOR_WEIGHT = 0.5, 2.0  # acceptance before any evidence, and its weight in drafts
DECAY = 0.9  # per sampling step: older evidence fades


@dataclass
class DraftBudget:
    k: int
    limit: int
    pause: int = 0  # steps left without drafting
    misses: int = 0  # consecutive verification steps with nothing accepted
    accepted: float = 0.0  # decayed count of accepted drafts
    rejections: float = 0.0  # decayed count of verifications that rejected a draft

    @classmethod
    def start(cls, k: int) -> "DraftBudget":
        return cls(k=k, limit=k)

    def take(self) -> int:
        """Drafts this step may verify (0 while paused); counts one step of a pause."""
        limit = self.peek()[0]
        self.pause = max(0, self.pause - 1)
        return limit

    def acceptance(self) -> float:
        """P(a draft is accepted | the draft before it was), from recent verifications."""
        return _estimate(self.accepted, self.rejections)

    def peek(self) -> tuple[int, float]:
        """(what the next ``take`` returns, ``acceptance()`` after this step's fade) if this step's verification
        adds no evidence; changes nothing."""
        return (0 if self.pause > 0 else self.limit), _estimate(DECAY * self.accepted, DECAY * self.rejections)

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """One sampling step of the request: evidence fades, then ``num_drafts`` verified drafts count (0: none)."""
        self.accepted *= DECAY
        self.rejections *= DECAY
        if num_drafts == 0:
            return
        self.accepted += num_accepted
        self.rejections += num_accepted < num_drafts
        if num_accepted == num_drafts:
            self.limit = min(self.k, self.limit + 2)
        elif 2 * num_accepted < num_drafts:
            self.limit = max(1, self.limit - 1)
        if num_accepted == 0:
            self.misses += 1
            self.pause = min(2 ** self.misses - 1, MAX_PAUSE)
        else:
            self.misses = 0


def _estimate(accepted: float, rejections: float) -> float:
    return (accepted + PRIOR * PRIOR_WEIGHT) / (accepted + rejections + PRIOR_WEIGHT)


def allocate_drafts(offers: list[tuple[int, float, int]], num_rows: int, row_cost: float,
                    max_drafts: int, step_cost: float = 0.0) -> list[int]:
    """How many drafts each sampling request verifies this step (see the module docstring).

    ``offers[i]`` = (drafts request i may verify, its acceptance estimate, how many of them lead
    the chain forced by its grammar); ``num_rows``: the forward's rows without drafts;
    ``max_drafts``: what the token budget leaves for drafts; ``step_cost``: the drafter's work, paid
    by a step that verifies any draft it made (forced drafts need none).
    """
    gains = sorted(((acceptance ** max(0, j - certain), j <= certain, i)
                    for i, (n, acceptance, certain) in enumerate(offers) for j in range(1, n + 1)),
                   key=lambda gain: -gain[0])  # stable: a request's drafts stay in order; forced ones (1) first
    counts = [0] * len(offers)
    tokens, rows = float(len(offers)), num_rows
    forced_only = None  # (counts, tokens, rows) before the first draft the drafter made
    for gain, certain, i in gains[:max_drafts]:
        if not certain and forced_only is None:
            forced_only = (list(counts), tokens, rows)
        if gain * (1 + row_cost * rows + (0.0 if forced_only is None else step_cost)) < row_cost * tokens:
            break
        counts[i] += 1
        tokens += gain
        rows += 1
    if forced_only is not None:  # the drafter's drafts must also beat the step without them
        base_counts, base_tokens, base_rows = forced_only
        if tokens * (1 + row_cost * base_rows) < base_tokens * (1 + row_cost * rows + step_cost):
            return base_counts
    return counts
