"""Attention backends over the paged KV cache, behind one interface and picked by name."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionBatch:
    """Host-side description of one forward for one KV-cache group (built by the runner).

    Requests are laid out back to back: request b owns tokens
    ``query_start_loc[b]:query_start_loc[b+1]``, which are the last ``q_len`` of its
    ``seq_lens[b]`` context tokens.
    """

    query_start_loc: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor  # [B] int64, context length after this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot each token's K/V goes to
    block_size: int
    max_query_len: int  # host-side bounds, so metadata can be built from device tensors without a sync
    max_seq_len: int


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> Any:
        """Turn the host description into device tensors once per forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D], kv_cache [2, num_slots, KVH, D] -> out [T, H, D].

        Writes this step's k/v into the cache at the slot mapping, then attends over each
        request's whole context.
        """


_BACKENDS = {"sdpa": ("eyas.model.attention.sdpa", "SdpaBackend"),
             "flex": ("eyas.model.attention.flex", "FlexBackend")}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: '{name}' is not one of {', '.join(sorted(_BACKENDS))}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def default_backend(device: torch.device) -> str:
    """sdpa on both devices for now: flex's flat varlen layout is correct on CUDA but ~28x slower
    per layer than sdpa at decode batch 32 (one query tile walks every request's keys)."""
    return "sdpa"
