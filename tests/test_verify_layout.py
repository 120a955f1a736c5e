"""VerifyLayout: the logit rows a step verifies, against the rows counted out by hand."""

from __future__ import annotations

import torch

from eyas.core.step import ScheduledRequest, SchedulerOutput
from eyas.core.verify_layout import VerifyLayout


def entry(num_new: int, drafts: list[int], will_sample: bool) -> ScheduledRequest:
    return ScheduledRequest(None, 0, num_new, drafts, [[]], will_sample, [False] * len(drafts))


def test_the_docstring_example():
    # A: a 3-token chunk that ends its prompt; B: its last token and 2 drafts
    layout = VerifyLayout.of(SchedulerOutput([entry(3, [], True), entry(1, [7, 8], True)], 6, [], {}))
    assert layout.sample_rows == [0, 1]
    assert layout.flat_rows.tolist() == [2, 3, 4, 5]
    assert layout.first.tolist() == [0, 1]
    assert layout.pad.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert layout.drafts.tolist() == [[0, 0], [7, 8]] and layout.rows_per_request == [1, 3]


def test_chunks_that_do_not_sample_are_skipped_but_shift_the_rows():
    # a mid-prompt chunk of 4 (no sampling), then a decode with 1 draft, then a plain decode
    plan = SchedulerOutput([entry(4, [], False), entry(1, [5], True), entry(1, [], True)], 7, [], {})
    layout = VerifyLayout.of(plan)
    assert layout.sample_rows == [1, 2]
    assert layout.flat_rows.tolist() == [4, 5, 6]  # tokens 0..3 belong to the chunk
    assert layout.pad.tolist() == [[0, 1], [2, 2]]
    assert layout.num_rows == 3


def test_no_sampling_request():
    layout = VerifyLayout.of(SchedulerOutput([entry(4, [], False)], 4, [], {}))
    assert layout.entries == [] and layout.num_rows == 0
    assert layout.drafts.shape == (0, 0) and layout.pad.shape == (0, 1)
    assert torch.equal(layout.num_drafts, torch.zeros(0, dtype=torch.int64))


def test_random_plans_follow_the_definition():
    """For 500 random plans: request r's logit rows first[r] .. first[r] + n are the forward's rows of its last
    committed token and its n drafts, in order, back to back; pad repeats each request's last row."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        entries = [entry(rng.randint(1, 40), [rng.randint(1, 99) for _ in range(rng.randint(0, 5))],
                         rng.random() < 0.7) for _ in range(rng.randint(0, 6))]
        entries = [e if e.will_sample else entry(e.num_new_tokens, [], False) for e in entries]
        layout = VerifyLayout.of(SchedulerOutput(entries, 0, [], {}))
        k = max((len(e.draft_token_ids) for e in entries if e.will_sample), default=0)
        start, row, r = 0, 0, 0
        for b, e in enumerate(entries):
            n = len(e.draft_token_ids)
            if e.will_sample:
                assert layout.sample_rows[r] == b and layout.first[r] == row and layout.num_drafts[r] == n
                assert layout.flat_rows[row:row + n + 1].tolist() == list(range(start + e.num_new_tokens - 1,
                                                                                 start + e.num_new_tokens + n))
                assert layout.pad[r].tolist() == [row + min(j, n) for j in range(k + 1)]
                assert layout.drafts[r].tolist() == e.draft_token_ids + [0] * (k - n)
                row, r = row + n + 1, r + 1
            start += e.num_new_tokens + n
        assert layout.num_rows == row and len(layout.entries) == r
