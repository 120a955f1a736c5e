"""Attention backend ``sdpa``: gather paged K/V, then PyTorch SDPA (the CUDA default; on a CPU, the
fallback where the ``cpu`` backend's C kernel cannot be built, and the ``cpu`` backend's path for
long queries).

Requests with short queries (decodes, verification chains of k+1 tokens) are attended in padded
batches, one per query length, so a decode is not padded to the longest verification chain in
the batch (on a CPU at batch 7 with 700-token contexts, padding 7 decodes to 9 query rows made
attention 4x dearer); requests with long queries (prefill chunks) are attended one at a time,
unpadded, so a batch of prompts of very different lengths wastes no work on padding.

Padded-batch example: two requests, block_size 4, request 0 decodes its 6th token (q_len 1,
seq_len 6), request 1 verifies 3 tokens (q_len 3, seq_len 9). Then max_q = 3, max_kv = 9,
``q_index`` = [[0, 0, 0], [1, 2, 3]] (padding repeats a real row), ``kv_slots`` row 0 = slots of
positions 0..5 from its block table then padding slot 0, and the mask lets query j of request b
(at position seq_len - q_len + j) see keys 0..position. Padded query rows see key 0 only, so no
row is fully masked.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.model.attention.base import AttentionBackend, AttentionBatch, UniformBatch, uniform_slots

LONG_QUERY = 32  # queries longer than this are attended per request, without padding
# on CUDA: not cuDNN's kernel, which builds a plan for every new shape (about 40 ms each on an H100, and
# context lengths change every step); the memory-efficient kernel takes any mask but not grouped KV heads
_CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 2-D index (a gather along dim 0); index_select is 2-3x faster than indexing on CPU."""
    return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, q_len, D], k/v [B, KVH, kv_len, D]; mask [B, 1, q_len, kv_len] bool, None = causal."""
    batch, num_heads, q_len, head_dim = q.shape
    groups = num_heads // k.shape[1]
    if mask is not None and q_len <= LONG_QUERY:
        # short queries: the query heads of a KV head become rows of one query, so K/V are read once, not
        # once per query head, and never copied per head (1 thread, 7 requests x 500 keys: q_len 2 0.88 ->
        # 0.51 ms, q_len 9 1.97 -> 1.65); on CUDA the copies were 3x the gathered K/V of every decode step
        folded = q.reshape(batch, k.shape[1], groups * q_len, head_dim)  # row g * q_len + j = head g's query j
        with sdpa_kernel(_CUDA_KERNELS) if q.is_cuda else nullcontext():
            out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(1, 1, groups, 1))
        return out.view(batch, num_heads, q_len, head_dim)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    with sdpa_kernel(_CUDA_KERNELS):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask, is_causal=mask is None)


@dataclass
class _Padded:
    token_index: torch.Tensor | None  # [N] flat tokens of the short requests; None = all T tokens, in order
    q_index: torch.Tensor  # [B, max_q] flat token index of each padded query
    out_index: torch.Tensor  # [N] padded row (b * max_q + j) of each token in token_index
    kv_slots: torch.Tensor  # [B, max_kv] cache slot of each context position
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool


@dataclass
class Single:
    start: int  # the request's tokens are start:end of the flat batch
    end: int
    kv_slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [1, 1, q_len, seq_len] bool; None = fresh prefill (plain causal)


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor  # [T]
    padded: list[_Padded]  # one per query length of the short requests
    singles: list[Single]


def _slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table_row[positions // block_size] * block_size + positions % block_size


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> SdpaMetadata:
        short, singles = split_requests(batch, device)
        qsl = batch.query_start_loc.tolist()
        by_length: dict[int, list[int]] = {}  # query length -> its short requests
        for b in short:
            by_length.setdefault(qsl[b + 1] - qsl[b], []).append(b)
        if len(by_length) == 1 and not singles:  # every token, in order
            padded = [self._padded(batch, None, device)]
        else:
            padded = [self._padded(batch, rows, device) for rows in by_length.values()]
        return SdpaMetadata(batch.slot_mapping.to(device), padded, singles)

    @staticmethod
    def _padded(batch: AttentionBatch, rows: list[int] | None, device: torch.device) -> _Padded:
        qsl, seq_lens, bs = batch.query_start_loc, batch.seq_lens, batch.block_size
        block_table = batch.block_table
        max_q, max_kv = batch.max_query_len, batch.max_seq_len
        starts, q_lens = qsl[:-1], qsl[1:] - qsl[:-1]
        if rows is not None:  # a host-side subset of the requests
            starts, q_lens, seq_lens, block_table = starts[rows], q_lens[rows], seq_lens[rows], block_table[rows]
            max_q, max_kv = int(q_lens.max()), int(seq_lens.max())
        on = seq_lens.device
        num_reqs = len(seq_lens)
        j = torch.arange(max_q, device=on)
        q_index = starts[:, None] + torch.minimum(j, q_lens[:, None] - 1)  # [B, max_q]
        real = j[None, :] < q_lens[:, None]  # [B, max_q]
        if rows is not None:
            token_index = q_index[real]  # [N], host tensors: no device sync
            out_index = (torch.arange(num_reqs)[:, None] * max_q + j)[real]
        else:  # every token, in order: index arithmetic only, so device inputs never sync
            num_tokens = len(batch.slot_mapping)
            token_req = torch.repeat_interleave(torch.arange(num_reqs, device=on), q_lens, output_size=num_tokens)
            token_index = None
            out_index = token_req * max_q + torch.arange(num_tokens, device=on) - starts[token_req]  # [T]
        kv_pos = torch.arange(max_kv, device=on)
        block_of = (kv_pos // bs).clamp(max=block_table.shape[1] - 1).expand(num_reqs, -1)
        kv_slots = block_table.gather(1, block_of) * bs + kv_pos % bs
        kv_slots = torch.where(kv_pos < seq_lens[:, None], kv_slots, 0)  # [B, max_kv]
        q_pos = (seq_lens - q_lens)[:, None] + j  # [B, max_q]
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal within the context
        if batch.sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - batch.sliding_window
        mask |= ~real[:, :, None] & (kv_pos == 0)  # padded rows see key 0
        return _Padded(None if token_index is None else token_index.to(device), q_index.to(device),
                       out_index.to(device), kv_slots.to(device), mask.unsqueeze(1).to(device))

    def build_uniform_metadata(self, batch: UniformBatch) -> SdpaMetadata:
        """Metadata of a uniform layout from device tensors only, so a CUDA graph can capture it: one
        padded batch straight over the uniform rows."""
        table, bs, width = batch.block_table, batch.block_size, batch.width
        num_reqs, dev = table.shape[0], table.device
        q_pos, real, slot_mapping = uniform_slots(batch)
        kv_pos = torch.arange(table.shape[1] * bs, device=dev)
        kv_slots = table[:, kv_pos // bs] * bs + kv_pos % bs
        kv_slots = torch.where(kv_pos < batch.seq_lens[:, None], kv_slots, 0)  # [B, W * bs]
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]
        if batch.sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - batch.sliding_window
        mask |= ~real[:, :, None] & (kv_pos == 0)  # padded rows see key 0
        rows = torch.arange(num_reqs * width, device=dev)
        padded = _Padded(None, rows.view(num_reqs, width), rows, kv_slots, mask.unsqueeze(1))
        return SdpaMetadata(slot_mapping, [padded], [])

    def forward(self, q, k, v, kv_cache, meta: SdpaMetadata):
        num_heads, head_dim = q.shape[1], q.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_slots, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = None
        for p in meta.padded:
            qp = _rows(q, p.q_index).transpose(1, 2)  # [B, H, max_q, D]
            kp = _rows(k_cache, p.kv_slots).transpose(1, 2)  # [B, KVH, max_kv, D]
            vp = _rows(v_cache, p.kv_slots).transpose(1, 2)
            res = _attend(qp, kp, vp, p.mask)
            res = res.transpose(1, 2).reshape(-1, num_heads, head_dim).index_select(0, p.out_index)
            if p.token_index is None:
                return res
            out = torch.empty_like(q) if out is None else out
            out[p.token_index] = res
        out = torch.empty_like(q) if out is None else out
        attend_singles(q, k_cache, v_cache, meta.singles, out)
        return out


def split_requests(batch: AttentionBatch, device: torch.device) -> tuple[list[int], list[Single]]:
    """The requests with short queries (at most LONG_QUERY tokens), and the long ones as ``Single``."""
    qsl, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()  # host tensors
    short, singles = [], []
    for b, seq_len in enumerate(seq_lens):
        start, end = qsl[b], qsl[b + 1]
        if end - start <= LONG_QUERY:
            short.append(b)
            continue
        kv_pos = torch.arange(seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        mask = None
        if end - start != seq_len or batch.sliding_window is not None:
            visible = kv_pos[None, :] <= q_pos[:, None]
            if batch.sliding_window is not None:
                visible &= kv_pos[None, :] > q_pos[:, None] - batch.sliding_window
            mask = visible[None, None].to(device)
        singles.append(Single(start, end, _slots(batch.block_table[b], kv_pos, batch.block_size).to(device), mask))
    return short, singles


def attend_singles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, singles: list[Single],
                   out: torch.Tensor) -> None:
    """Each long query over its gathered context, one request at a time, into ``out`` [T, H, D]."""
    for s in singles:
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        ks = k_cache.index_select(0, s.kv_slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, seq_len, D]
        vs = v_cache.index_select(0, s.kv_slots).transpose(0, 1).unsqueeze(0)
        res = _attend(qs, ks, vs, s.mask)
        out[s.start:s.end] = res[0].transpose(0, 1)
