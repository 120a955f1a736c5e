"""Leaving a hidden-state drafter's requests out while their drafts would be dropped, and catching up later.

The draft prefill keeps the drafter's KV cache in step with the target's: every step it runs over the
verification layout, pairing the token after each position with the target's hidden state there
(``eyas.spec_decode.speculator``). A request runs in it only when it drafts: when it samples this step and the
scheduler expects to verify its drafts next step (``ProposerInput.expected_drafts`` > 0, see
``eyas.spec_decode.adaptive``). Every other request of the layout is left out: a prompt chunk that does not
sample, and a request told 0. So that it can draft later:

* every step, the hidden states the prefill reads go to a paged store, for every row of the layout: a
  cache-only layer (``eyas.model.cache_only``) in a KV-cache group of its own, which follows the target's
  block tables through chunked prefill, preemption and prefix caching;
* one bit per cache slot says whether the drafter's entry there belongs to the target's entry there: set
  where the draft prefill ran over the slot, cleared where the target wrote it and the drafter did not. Every
  write of the target passes through here, so the bits stay true whoever held the slot before: a block the
  prefix cache shares keeps the bits of the request that filled it;
* when a request drafts, its prefill query starts at its first position whose bit is clear (or at its
  layout rows, if there is none): the rows of positions first .. s-1 (s: its first position in this step's
  layout) read the store and the committed tokens after them, then its layout rows follow. The prefill fills
  them and drafts from the last row as usual.

So a prompt costs the drafter nothing until its request first drafts, and then one prefill over all of it;
a request the cost model never lets draft (a long prompt at batch 8 on a CPU) never costs it anything.

Example: request A decodes with one draft a step and is told 0 at the steps whose layouts start at positions
40, 41 and 42 (the last committed token; its drafts were dropped): nothing runs for it, and the bits of
positions 40.. are cleared. At the step whose layout starts at 43 (x43, then its draft) it is told 1: its
prefill query covers positions 40..44, rows 40..42 from the store with tokens x41..x43 from its history, rows
43..44 from the layout. Request B is admitted with a prompt of 300 tokens whose first 256 the prefix cache held
from a request that never drafted; the step that computes its last 44 samples its first token, and if it is
told to draft then, its query covers positions 0..299: 256 rows from the store, 44 from the layout.

Cost: the store holds the drafter's input of every token, ``len(aux_layer_ids) * hidden`` values for EAGLE-3
(``hidden`` for EAGLE-1 and MTP): on SmolLM2-135M in float32, 6,912 bytes a token beside the target's 46,080
and EAGLE-3's own 1,536, and the bits one byte a token. It exists with adaptive drafting only, the one mode in
which a request is told 0; without it every request of the layout drafts and the prefill runs over all of
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from eyas.core.host_ints import host_ints
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import request_slots
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
    """The store of drafter inputs and the bits of the slots with drafter entries (see the module docstring)."""

    def __init__(self, width: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.store = CacheOnlyLayer(1, width, kv_cache_group=-1)  # one row of ``width`` values a token
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.filled = np.zeros((0, block_size), dtype=bool)  # [blocks, block_size] host; bound by bind_kv_cache

    def kv_cache_group(self, name: str) -> KVCacheGroupSpec:
        return KVCacheGroupSpec(name, (name,), self.store.bytes_per_token(self.dtype))

    def bind_kv_cache(self, num_slots: int, group: int) -> None:
        self.store.kv_cache_group = group
        self.store.bind_cache(num_slots, self.dtype, self.device)
        self.filled = np.zeros((num_slots // self.block_size, self.block_size), dtype=bool)

    def _first_unfilled(self, blocks: list[int], start: int) -> int:
        """The first of positions 0 .. start-1 of a request holding ``blocks`` whose drafter entry is missing
        (start: none)."""
        bits = self.filled[blocks[:-(-start // self.block_size)]].ravel()[:start]
        return start if bits.all() else int(bits.argmin())

    def batch(self, inp: ProposerInput, next_ids: Callable[[], torch.Tensor], hidden: torch.Tensor
              ) -> DraftBatch | None:
        """Store this step's ``hidden`` [num_tokens, H_in], then the batch the draft prefill runs over (None: no
        request drafts); ``next_ids()`` [num_tokens] is the token after each layout row (called only for a batch).
        Most steps draft for nobody and only store their rows: their slots are host ints (``request_slots``)."""
        group = self.store.kv_cache_group
        laid_out = inp.slots_in(group, self.block_size)  # [T] the store's slot of each layout row
        self.store.write(hidden[:, None], host_ints(laid_out).to(self.device))
        flat = self.filled.reshape(-1)  # a view
        drafting = {b: r for r, b in enumerate(inp.sample_rows) if inp.expected_drafts[r] > 0}
        if not drafting:  # most steps: the rows are stored, and no draft prefill ran over them
            flat[laid_out] = False
            return None
        qsl, seq_lens = inp.query_start_loc.tolist(), inp.seq_lens.tolist()
        starts = [seq_len - (qsl[b + 1] - qsl[b]) for b, seq_len in enumerate(seq_lens)]  # each one's first layout row
        num_tokens = qsl[-1]
        requests, q_lens, rows = [], [], []  # rows: index into the layout's rows, then the caught-up rows
        tokens, positions, caught = [], [], []  # of the caught-up rows: next token, position, slot
        ran = np.zeros(num_tokens, dtype=bool)  # [T] whether the prefill runs over layout row t
        for b, (start, seq_len) in enumerate(zip(starts, seq_lens)):
            if b not in drafting:
                continue
            blocks = inp.block_tables[b][group]
            first = self._first_unfilled(blocks, start)
            rows += range(num_tokens + len(tokens), num_tokens + len(tokens) + start - first)
            tokens += inp.token_ids[drafting[b]][first + 1:start + 1]
            positions += range(first, start)
            caught += request_slots(blocks, range(first, start), self.block_size)
            rows += range(qsl[b], qsl[b + 1])
            ran[qsl[b]:qsl[b + 1]] = True
            requests.append(b)
            q_lens.append(seq_len - first)
        flat[laid_out] = ran
        if len(requests) == len(seq_lens) and not tokens:
            return DraftBatch.of_layout(inp, next_ids(), hidden)
        if tokens:
            flat[caught] = True
            laid_out_ids = next_ids()
            ids = torch.cat([laid_out_ids, torch.tensor(tokens, dtype=laid_out_ids.dtype, device=laid_out_ids.device)])
            stored = self.store.gather(torch.tensor(caught, dtype=torch.int64, device=self.device))[:, 0]  # [C, H_in]
            hidden = torch.cat([hidden, stored])
            all_positions = torch.cat([inp.positions, torch.tensor(positions, dtype=torch.int64,
                                                                   device=inp.positions.device)])
        else:
            ids, all_positions = next_ids(), inp.positions
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
        return DraftBatch(ids.index_select(0, index), all_positions.index_select(0, index),
                          hidden.index_select(0, index), query_start_loc, torch.tensor([seq_lens[b] for b in requests]),
                          requests)
