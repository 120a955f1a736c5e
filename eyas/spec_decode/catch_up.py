"""Leaving a hidden-state drafter's requests out while their drafts would be dropped, and catching up later.

The draft prefill keeps the drafter's KV cache in step with the target's: every step it runs over the
verification layout, pairing the token after each position with the target's hidden state there
(``eyas.spec_decode.speculator``). When the scheduler expects to verify no drafts of a sampling request next step
(``ProposerInput.expected_drafts`` 0, see ``eyas.spec_decode.adaptive``), the speculator leaves that request out of
the step entirely: no prefill rows, no draft head, no decode steps. So that it can draft again later:

* every step, the hidden states the prefill reads go to a paged store, for every row of the layout: a
  cache-only layer (``eyas.model.cache_only``) in a KV-cache group of its own, which follows the target's
  block tables through chunked prefill, preemption and prefix caching;
* the first position of a request left out is kept (its gap); every position before it has drafter entries;
* when the request drafts again, its prefill query starts at its gap: the rows of positions gap .. s-1 (s:
  its first position in this step's layout) read the store and the committed tokens after them, then its
  layout rows follow. The prefill fills the gap and drafts from the last row as usual.

Prompt chunks that do not sample carry no expectation and always run; so even after a preemption recomputes
a request, every position before its gap has drafter entries (a catch-up may recompute some of them: the
same values). Where a recomputed request's last chunk starts before its gap, the gap moves back to it.

Example: request A decodes with one draft a step and is told 0 at the steps whose layouts start at positions
40, 41 and 42 (the last committed token; its drafts were dropped): nothing runs for it, its gap is 40. At the
step whose layout starts at 43 (x43, then its draft) it is told 1: its prefill query covers positions 40..44,
rows 40..42 from the store with tokens x41..x43 from its history, rows 43..44 from the layout.

Cost: the store holds the drafter's input of every token, ``len(aux_layer_ids) * hidden`` values for EAGLE-3
(``hidden`` for EAGLE-1 and MTP): on SmolLM2-135M in float32, 6,912 bytes a token beside the target's 46,080
and EAGLE-3's own 1,536. It exists with adaptive drafting only, the one mode in which a request is told 0.
Prefix caching: a block filled while its request was left out has no drafter entries at those positions; a
request that shares it drafts over them without catching up (outputs are unaffected, acceptance can dip),
like the stale entry of a shared block described in ``eyas.spec_decode.speculator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import block_table_tensor, layout_slots
from eyas.model.cache_only import CacheOnlyLayer
from eyas.spec_decode.proposer import ProposerInput


@dataclass
class DraftBatch:
    """What one draft prefill runs over: some requests of the verification layout, each query possibly
    starting before its layout rows (catch-up rows first). Request i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last q_len positions of its ``seq_lens[i]``."""

    input_ids: torch.Tensor  # [T'] the token after each row's position
    positions: torch.Tensor  # [T']
    hidden: torch.Tensor  # [T', H_in] the target's state at each row's position, as the drafter reads it
    query_start_loc: torch.Tensor  # [B'+1] host
    seq_lens: torch.Tensor  # [B'] host
    requests: list[int]  # [B'] index b of each request in the verification layout

    @classmethod
    def of_layout(cls, inp: ProposerInput, next_ids: torch.Tensor, hidden: torch.Tensor) -> "DraftBatch":
        """Every request of the verification layout, nothing to catch up."""
        return cls(next_ids, inp.positions, hidden, inp.query_start_loc, inp.seq_lens, list(range(len(inp.seq_lens))))


class CatchUp:
    """The store of drafter inputs and the gap of every request left out (see the module docstring)."""

    def __init__(self, width: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.store = CacheOnlyLayer(1, width, kv_cache_group=-1)  # one row of ``width`` values a token
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.gaps: dict[str, int] = {}  # request id -> its first position without drafter entries

    def kv_cache_group(self, name: str) -> KVCacheGroupSpec:
        return KVCacheGroupSpec(name, (name,), self.store.bytes_per_token(self.dtype))

    def bind_kv_cache(self, num_slots: int, group: int) -> None:
        self.store.kv_cache_group = group
        self.store.bind_cache(num_slots, self.dtype, self.device)

    def batch(self, inp: ProposerInput, next_ids: torch.Tensor, hidden: torch.Tensor) -> DraftBatch | None:
        """Store this step's ``hidden`` [num_tokens, H_in], then the batch the draft prefill runs over (None: no
        request); ``next_ids`` [num_tokens] is the token after each layout row."""
        table = block_table_tensor([t[self.store.kv_cache_group] for t in inp.block_tables])  # [B, blocks]
        _, slots = layout_slots(table, inp.query_start_loc, inp.seq_lens, self.block_size)
        self.store.write(hidden[:, None], slots.to(self.device))
        qsl, seq_lens = inp.query_start_loc.tolist(), inp.seq_lens.tolist()
        row_of = {b: r for r, b in enumerate(inp.sample_rows)}
        num_tokens = qsl[-1]
        requests, q_lens, rows = [], [], []  # rows: index into the layout's rows, then the caught-up rows
        tokens, positions = [], []  # of the caught-up rows
        for b, seq_len in enumerate(seq_lens):
            start = seq_len - (qsl[b + 1] - qsl[b])  # position of its first layout row
            first = start
            if b in row_of:
                r = row_of[b]
                request_id = inp.request_ids[r]
                if inp.expected_drafts[r] == 0:
                    self.gaps[request_id] = min(self.gaps.get(request_id, start), start)
                    continue
                first = min(self.gaps.pop(request_id, start), start)
                rows += range(num_tokens + len(tokens), num_tokens + len(tokens) + start - first)
                tokens += inp.token_ids[r][first + 1:start + 1]
                positions += [(b, p) for p in range(first, start)]
            rows += range(qsl[b], qsl[b + 1])
            requests.append(b)
            q_lens.append(seq_len - first)
        if not requests:
            return None
        if len(requests) == len(seq_lens) and not tokens:
            return DraftBatch.of_layout(inp, next_ids, hidden)
        if tokens:
            at = torch.tensor(positions, dtype=torch.int64)  # [C, 2] (layout request b, position)
            caught = at[:, 1]
            caught_slots = table[at[:, 0], caught // self.block_size] * self.block_size + caught % self.block_size
            next_ids = torch.cat([next_ids, torch.tensor(tokens, dtype=next_ids.dtype, device=next_ids.device)])
            hidden = torch.cat([hidden, self.store.gather(caught_slots.to(self.device))[:, 0]])
            all_positions = torch.cat([inp.positions, caught.to(inp.positions.device)])
        else:
            all_positions = inp.positions
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
        return DraftBatch(next_ids.index_select(0, index), all_positions.index_select(0, index),
                          hidden.index_select(0, index), query_start_loc, torch.tensor([seq_lens[b] for b in requests]),
                          requests)

    def forget(self, request_id: str) -> None:
        self.gaps.pop(request_id, None)
