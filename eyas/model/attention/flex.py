"""CUDA attention backend: FlexAttention over a flat, unpadded (varlen) gather of the paged K/V.

Every request's context is gathered from the cache into one flat K/V of ``sum(seq_lens)``
rows, laid out in request order like the queries. Query ``t`` of request ``b`` (at context
position ``p``) may then see exactly the flat K/V rows ``kv_start[b] .. kv_start[b] + p``: one
interval per query, so the mask is ``q_lo[t] <= kv <= q_hi[t]`` and needs no per-key lookup.

Example: request 0 decodes its 6th token (q_len 1, seq_len 6), request 1 prefills 3 tokens
(q_len 3, seq_len 3). Flat K/V rows 0..5 are request 0's positions 0..5, rows 6..8 request 1's
positions 0..2. ``q_lo`` = [0, 6, 6, 6], ``q_hi`` = [5, 6, 7, 8].

Since requests are back to back in both layouts, ``q_lo`` and ``q_hi`` never decrease, so the
keys a tile of 128 queries needs form one contiguous run of 128-key tiles, from the tile of its
first query's ``q_lo`` to the tile of its last query's ``q_hi``: the ``BlockMask`` is built at
tile granularity straight from that (no dense mask is evaluated). All visited tiles are
"partial" (the mask is applied everywhere), which costs little next to the two matmuls.

Shapes change every step, so the kernel is compiled with dynamic shapes: in practice once for
short query sets (tokens x query heads per KV head <= 128, e.g. a decode batch of 32 with 4-way
GQA: FlexAttention's split-KV decoding kernel) and once or twice for longer ones (one query
tile, several).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eyas.model.attention.base import AttentionBackend, AttentionBatch

TILE = 128  # FlexAttention's sparse block size, for queries and keys alike
_flex_attention = torch.compile(flex_attention, dynamic=True)
_MAIN_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}


@dataclass
class FlexMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    kv_slots: torch.Tensor  # [S] cache slot of each flat K/V row, S = sum(seq_lens)
    block_mask: BlockMask  # over [T queries, S keys]


def _interval_mask(q_lo: torch.Tensor, q_hi: torch.Tensor):
    def mask_mod(b, h, q, kv):
        return (kv >= q_lo[q]) & (kv <= q_hi[q])
    return mask_mod


class FlexBackend(AttentionBackend):
    name = "flex"

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> FlexMetadata:
        if batch.sliding_window is not None:
            raise ValueError("attention_backend: 'flex' has no sliding-window layers yet; use 'sdpa'")
        qsl, seq_lens, bs = batch.query_start_loc, batch.seq_lens, batch.block_size
        num_tokens, num_kv = int(qsl[-1]), int(seq_lens.sum())  # host tensors: no device sync
        num_reqs = len(seq_lens)
        qsl, seq_lens = qsl.to(device, non_blocking=True), seq_lens.to(device, non_blocking=True)
        block_table = batch.block_table.to(device, non_blocking=True)
        kv_end = seq_lens.cumsum(0)  # [B] flat K/V row after each request's last
        kv_start = kv_end - seq_lens
        reqs = torch.arange(num_reqs, device=device)
        # flat K/V row -> cache slot
        kv_req = torch.repeat_interleave(reqs, seq_lens, output_size=num_kv)  # [S]
        kv_pos = torch.arange(num_kv, device=device) - kv_start[kv_req]
        kv_slots = block_table[kv_req, kv_pos // bs] * bs + kv_pos % bs  # [S]
        # query -> the interval of flat K/V rows it sees
        q_req = torch.repeat_interleave(reqs, qsl[1:] - qsl[:-1], output_size=num_tokens)  # [T]
        t = torch.arange(num_tokens, device=device)
        q_lo = kv_start[q_req]  # [T]
        q_hi = t + (kv_end - qsl[1:])[q_req]  # [T] = kv_start + position
        # tile i of queries visits key tiles lo_tile[i] .. hi_tile[i]
        num_q_tiles, num_kv_tiles = -(-num_tokens // TILE), -(-num_kv // TILE)
        first = torch.arange(num_q_tiles, device=device) * TILE
        last = torch.clamp(first + TILE - 1, max=num_tokens - 1)
        lo_tile, hi_tile = q_lo[first] // TILE, q_hi[last] // TILE  # [QT]
        k = torch.arange(num_kv_tiles, device=device)
        kv_indices = torch.clamp(lo_tile[:, None] + k, max=num_kv_tiles - 1)  # [QT, KT]
        kv_num_blocks = (hi_tile - lo_tile + 1).to(torch.int32)[None, None]  # [1, 1, QT]
        kv_indices = kv_indices.to(torch.int32)[None, None]  # [1, 1, QT, KT]
        torch._dynamo.maybe_mark_dynamic(kv_indices, 3)  # else the first step's KT is baked in
        block_mask = BlockMask.from_kv_blocks(
            kv_num_blocks, kv_indices, BLOCK_SIZE=TILE,
            mask_mod=_interval_mask(q_lo, q_hi), seq_lengths=(num_tokens, num_kv), compute_q_blocks=False)
        return FlexMetadata(batch.slot_mapping.to(device, non_blocking=True), kv_slots, block_mask)

    def forward(self, q, k, v, kv_cache, meta: FlexMetadata):
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_slots, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        kf = k_cache[meta.kv_slots].transpose(0, 1)[None]  # [1, KVH, S, D]
        vf = v_cache[meta.kv_slots].transpose(0, 1)[None]
        # FlexAttention's split-KV decoding kernel sizes its query tile from the first length it
        # is compiled for and needs that tile to fit one 128-row block: pick it only then
        short = q.shape[0] * (q.shape[1] // k.shape[1]) <= TILE
        out = _flex_attention(q.transpose(0, 1)[None], kf, vf, block_mask=meta.block_mask, enable_gqa=True,
                              kernel_options={} if short else _MAIN_KERNEL)  # [1, H, T, D]
        return out[0].transpose(0, 1)  # [T, H, D]
