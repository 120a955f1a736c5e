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
