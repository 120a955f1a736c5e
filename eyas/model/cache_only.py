"""A cache-only layer: stores per-token tensors in the paged cache and computes nothing.

Laid out like an attention layer's cache whose "heads" are the stored rows and whose "head
size" is their width, but with one tensor per slot (no separate K and V halves). Hidden-state
extraction uses it with rows = the aux layers and width = the hidden size, so a request's aux
states live in blocks of their own KV-cache group and follow the same block tables, prefix
cache and preemption as the target's K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.model.host_memory import cache_zeros


class CacheOnlyLayer(nn.Module):
    def __init__(self, num_rows: int, width: int, kv_cache_group: int):
        super().__init__()
        self.num_rows, self.width = num_rows, width
        self.kv_cache_group = kv_cache_group
        self.kv_cache: torch.Tensor | None = None  # [num_slots, num_rows, width], bound by bind_cache

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_rows * self.width * dtype.itemsize

    def bind_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv_cache = cache_zeros((num_slots, self.num_rows, self.width), dtype, device)

    def write(self, states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """states [num_tokens, num_rows, width] go to their slots; padding tokens carry a slot of the
        null block, which no request reads."""
        self.kv_cache.index_copy_(0, slot_mapping, states.to(self.kv_cache.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [n] -> [n, num_rows, width]."""
        return self.kv_cache.index_select(0, slots)
