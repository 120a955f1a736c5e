"""The attention backends' one interface and the batch descriptions they read, over the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eyas.core.host_ints import host_ints
from eyas.kv.block_pool import NULL_BLOCK


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
    sliding_window: int | None = None  # a query sees only the last ``sliding_window`` keys (itself included)


@dataclass
class UniformBatch:
    """Device-side description of a forward over a *uniform* layout, for CUDA graphs
    (``SdpaBackend.build_uniform_metadata``).

    Request b owns rows ``b * width .. b * width + width - 1``; the first ``q_lens[b]`` are its
    real tokens, the last ``q_lens[b]`` of its ``seq_lens[b]`` context tokens, and the rest are
    padding. Every tensor lives on the device and the shapes depend only on (B, width, W), so
    metadata built from it needs no host read and can be captured in a graph. Padding rows write
    into the null block and see key 0 only; a padding request has q_len 0 and seq_len 0.

    Example (block_size 4, width 3): request 0 with q_len 1, seq_len 6 owns rows 0..2, row 0 at
    position 5 (slot ``table[0, 1] * 4 + 1``), rows 1 and 2 padding.
    """

    q_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, W] int64, padded with the null block; keys 0 .. W * block_size - 1 are visited
    block_size: int
    width: int  # rows per request
    sliding_window: int | None = None


def block_table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """Host block tables of one group -> [B, max_blocks] int64, padded with the null block 0."""
    width = max(1, max(len(t) for t in tables))
    return host_ints([t + [NULL_BLOCK] * (width - len(t)) for t in tables], (len(tables), width))  # one copy, not B


def request_slots(blocks: list[int], positions, block_size: int) -> list[int]:
    """The cache slots of a request's ``positions`` (an iterable of ints), ``blocks`` being its block table in one
    group. Host ints: a proposer storing a step's few rows between two forwards, which leave the caches cold, paid
    more for a round trip through a block-table tensor and NumPy (0.13 ms a step at batch 1, against 0.08)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def layout_slots(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and cache slots of every token of a back-to-back layout (host tensors, no sync).

    Request b owns tokens ``query_start_loc[b]:query_start_loc[b+1]``, the last ``q_len`` of its
    ``seq_lens[b]`` context. Example (block_size 4): one request with seq_len 6 and q_len 2 has
    positions [4, 5], which live in its second block: slots ``table[b, 1] * 4 + [0, 1]``.
    Returns (positions [T], slot_mapping [T]). In NumPy: a decode step's handful of rows costs about 20 us here
    against 50 in torch ops (each about 5 us of dispatch).
    """
    qsl, table = query_start_loc.numpy(), block_table.numpy()
    q_lens = qsl[1:] - qsl[:-1]
    req = np.repeat(np.arange(len(q_lens)), q_lens)  # [T] the request of each token
    positions = (seq_lens.numpy() - q_lens)[req] + np.arange(int(qsl[-1])) - qsl[:-1][req]
    slots = table[req, positions // block_size] * block_size + positions % block_size
    return torch.from_numpy(positions), torch.from_numpy(slots)


def uniform_slots(batch: UniformBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, real-row mask and cache slots of a uniform layout (device tensors, no sync).

    Returns (positions [B, width], real [B, width] bool, slot_mapping [B * width]); padding rows
    write into the null block (slot 0).
    """
    table, bs = batch.block_table, batch.block_size
    j = torch.arange(batch.width, device=table.device)
    real = j < batch.q_lens[:, None]  # [B, width]
    positions = (batch.seq_lens - batch.q_lens)[:, None] + j  # [B, width]
    block_of = (positions // bs).clamp(0, table.shape[1] - 1)
    slot_mapping = torch.where(real, table.gather(1, block_of) * bs + positions % bs, 0).flatten()
    return positions, real, slot_mapping


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
