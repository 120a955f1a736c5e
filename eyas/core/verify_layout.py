"""Where a step's verification reads its rows: built once from the plan, read by the runner's verification,
grammar masks, logprobs and proposer input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.core.host_ints import host_ints
from eyas.core.step import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class VerifyLayout:
    """The R requests that sample this step and the N = R + sum(num_drafts) logit rows they verify.

    The target's forward lays the plan's B requests out back to back (request b owns tokens
    ``query_start_loc[b]:query_start_loc[b+1]``). A sampling request's verify positions are its last committed
    token and then its drafts; only those rows get logits, request r's at rows ``first[r] .. first[r] +
    num_drafts[r]`` of the logits. ``pad`` lays them out as [R, k+1], positions past a request's drafts
    repeating its last row.

    Example: requests A (a 3-token prompt chunk that ends its prompt, no drafts) and B (its last token + 2
    drafts): query_start_loc [0, 3, 6], k = 2. ``flat_rows`` [2, 3, 4, 5] (A's last token; B's three tokens),
    ``first`` [0, 1], ``pad`` [[0, 0, 0], [1, 2, 3]].
    """

    sample_rows: list[int]  # [R] index b, in the plan, of each sampling request
    entries: list[ScheduledRequest]  # [R] the plan's entries of those requests
    num_drafts: torch.Tensor  # [R] int64 host
    drafts: torch.Tensor  # [R, k] int64 host, padded with 0
    flat_rows: torch.Tensor  # [N] int64 host: the forward's token row of each logit row
    first: torch.Tensor  # [R] int64 host: each request's first logit row
    pad: torch.Tensor  # [R, k+1] int64 host: logit row of verify position j of request r

    @classmethod
    def of(cls, plan: SchedulerOutput) -> VerifyLayout:
        """Built in Python and made into tensors once: a batch-1 step is a handful of integers, and tensor
        arithmetic on them cost 0.17 ms a step, 2% of a decode step."""
        sample_rows, entries, lasts = [], [], []
        start = 0  # each request's first token in the forward
        for b, entry in enumerate(plan.scheduled):
            if entry.will_sample:
                sample_rows.append(b)
                entries.append(entry)
                lasts.append(start + entry.num_new_tokens - 1)
            start += entry.num_new_tokens + len(entry.draft_token_ids)
        counts = [len(e.draft_token_ids) for e in entries]
        k = max(counts, default=0)
        first, pad, flat_rows, row = [], [], [], 0
        for n, last in zip(counts, lasts):
            first.append(row)
            pad.append([row + min(j, n) for j in range(k + 1)])
            flat_rows += range(last, last + n + 1)
            row += n + 1
        r = len(entries)
        return cls(sample_rows, entries, host_ints(counts),
                   host_ints([e.draft_token_ids + [0] * (k - n) for e, n in zip(entries, counts)], (r, k)),
                   host_ints(flat_rows), host_ints(first), host_ints(pad, (r, k + 1)))

    @property
    def num_rows(self) -> int:
        """N, the logit rows."""
        return int(self.flat_rows.shape[0])

    @property
    def rows_per_request(self) -> list[int]:
        """[R] num_drafts + 1: how many logit rows each request owns."""
        return (self.num_drafts + 1).tolist()
