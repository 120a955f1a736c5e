"""CPU attention backend: short queries read K/V in place from the paged cache, long ones go through SDPA.

Decodes and verification chains (queries of at most ``LONG_QUERY`` tokens) are attended by
eyas's C kernel (``eyas/kernels/paged_attention.c``), which walks each request's block table
and reads K/V straight from the cache: nothing is gathered or padded. The gather-then-SDPA path
copies every request's context, padded to the longest one, twice per layer (K and V) and then
reads the copy again; at batch 32 with 100-400-token contexts on the project's 2-core CPU that
was half of a decode step (150 of 300 ms). Prefill chunks (long queries) are matrix products
that SDPA's blocked kernel does well, so they keep the gather-then-SDPA path of ``sdpa``.

Kernel inputs per short request n: ``q_start[n]`` (first query row), ``q_len[n]``, ``seq_len[n]``
and ``row[n]`` (its block table row). A flat batch lists its short requests; a uniform layout
(width rows per request, the CUDA-graph layout that draft steps also use on the CPU) lists all,
with ``q_start = b * width``, and leaves padding rows at zero.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from eyas import kernels
from eyas.model.attention import AttentionBackend, AttentionBatch, UniformBatch, uniform_slots
from eyas.model.attention.sdpa import Single, attend_singles, split_requests

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load_kernel():
    """The C kernel's entry point, or None where it cannot be built (then the ``sdpa`` backend serves)."""
    return kernels.entry("paged_attention", _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _i64, _ptr, _i64, _i64, _ptr, _ptr,
                         _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int)


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    requests: torch.Tensor  # [4, N] int64 rows q_start, q_len, seq_len, block-table row of the short requests
    block_table: torch.Tensor  # [B, W] int64, contiguous
    block_size: int
    window: int  # keys a query sees (itself included); 0 = all
    zero_fill: bool  # rows outside every listed request must read 0 (uniform layouts' padding)
    singles: list[Single]  # long queries, through SDPA


def _int64(t: torch.Tensor) -> torch.Tensor:
    """What the kernel reads: int64, contiguous (a no-op for the runner's tensors)."""
    return t.to(torch.int64).contiguous()


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        self._kernel = load_kernel()
        if self._kernel is None:
            raise ValueError("attention_backend: 'cpu' needs its C kernel, which could not be built here (see the "
                             "log); use 'sdpa'")

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> CpuMetadata:
        short, singles = split_requests(batch, device)
        rows = torch.tensor(short, dtype=torch.int64)
        starts = batch.query_start_loc[rows]
        q_lens = batch.query_start_loc[rows + 1] - starts
        requests = torch.stack([starts, q_lens, batch.seq_lens[rows], rows])
        return CpuMetadata(batch.slot_mapping, _int64(requests), _int64(batch.block_table), batch.block_size,
                           batch.sliding_window or 0, False, singles)

    def build_uniform_metadata(self, batch: UniformBatch) -> CpuMetadata:
        _, _, slot_mapping = uniform_slots(batch)
        rows = torch.arange(batch.q_lens.shape[0])
        requests = torch.stack([rows * batch.width, batch.q_lens, batch.seq_lens, rows])
        return CpuMetadata(slot_mapping, _int64(requests), _int64(batch.block_table), batch.block_size,
                           batch.sliding_window or 0, True, [])

    def forward(self, q, k, v, kv_cache, meta: CpuMetadata):
        num_tokens, num_heads, head_dim = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_slots, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        qf = q.float().contiguous()  # [T, H, D]
        out = (torch.zeros if meta.zero_fill else torch.empty)(num_tokens, num_heads, head_dim)
        requests = meta.requests
        assert k_cache.stride(1) == head_dim and k_cache.stride(2) == 1 and v_cache.stride(0) == k_cache.stride(0)
        if requests.shape[1]:
            status = self._kernel(
                qf.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _CACHE_DTYPES[k_cache.dtype],
                k_cache.stride(0), meta.block_table.data_ptr(), meta.block_table.shape[1], meta.block_size,
                requests[0].data_ptr(), requests[1].data_ptr(), requests[2].data_ptr(), requests[3].data_ptr(),
                requests.shape[1], num_heads, k_cache.shape[1], head_dim, meta.window, head_dim ** -0.5,
                torch.get_num_threads())
            if status != 0:
                raise MemoryError("paged attention kernel: out of memory for its work buffers")
        attend_singles(q, k_cache, v_cache, meta.singles, out)
        return out.to(q.dtype)
