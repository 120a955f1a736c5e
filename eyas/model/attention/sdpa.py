"""CPU attention backend: gather each request's paged K/V into a padded batch, then SDPA.

Example: two requests, block_size 4, request 0 decodes its 6th token (q_len 1, seq_len 6),
request 1 prefills 3 tokens (q_len 3, seq_len 3). Then max_q = 3, max_kv = 6,
``q_index`` = [[0, 0, 0], [1, 2, 3]] (padding repeats a real row), ``kv_slots`` row 0 =
slots of positions 0..5 from its block table, row 1 = positions 0..2 then padding slot 0,
and the mask lets query j of request b (at position seq_len - q_len + j) see keys
0..position. Padded query rows see key 0 only, so no row is fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.model.attention import AttentionBackend, AttentionBatch


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor  # [T]
    q_index: torch.Tensor  # [B, max_q] flat token index of each padded query
    out_index: torch.Tensor  # [T] padded row (b * max_q + j) of each token
    kv_slots: torch.Tensor  # [B, max_kv] cache slot of each context position
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, None = plain causal single request


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> SdpaMetadata:
        qsl, seq_lens, bs = batch.query_start_loc, batch.seq_lens, batch.block_size
        on = seq_lens.device
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        num_reqs, num_tokens = len(seq_lens), len(batch.slot_mapping)
        max_q, max_kv = batch.max_query_len, batch.max_seq_len
        j = torch.arange(max_q, device=on)
        q_index = (qsl[:-1, None] + torch.minimum(j, q_lens[:, None] - 1))  # [B, max_q]
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=on), q_lens, output_size=num_tokens)
        out_index = token_req * max_q + (torch.arange(num_tokens, device=on) - qsl[:-1][token_req])  # [T]
        kv_pos = torch.arange(max_kv, device=on)
        width = batch.block_table.shape[1]
        block_of = (kv_pos // bs).clamp(max=width - 1).expand(num_reqs, -1)
        kv_slots = batch.block_table.gather(1, block_of) * bs + kv_pos % bs
        kv_slots = torch.where(kv_pos < seq_lens[:, None], kv_slots, 0)  # [B, max_kv]
        mask = None
        if not (num_reqs == 1 and max_q == max_kv):  # anything but a fresh single prefill
            q_pos = (seq_lens - q_lens)[:, None] + j  # [B, max_q]
            mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal within the context
            mask |= (j[None, :, None] >= q_lens[:, None, None]) & (kv_pos == 0)  # padded rows see key 0
            mask = mask.unsqueeze(1).to(device)
        return SdpaMetadata(batch.slot_mapping.to(device), q_index.to(device), out_index.to(device),
                            kv_slots.to(device), mask)

    def forward(self, q, k, v, kv_cache, meta: SdpaMetadata):
        num_tokens, num_heads, head_dim = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_slots, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        qp = q[meta.q_index].transpose(1, 2)  # [B, H, max_q, D]
        kp = k_cache[meta.kv_slots].transpose(1, 2)  # [B, KVH, max_kv, D]
        vp = v_cache[meta.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, is_causal=meta.mask is None,
                                             enable_gqa=True)  # [B, H, max_q, D]
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)[meta.out_index]
