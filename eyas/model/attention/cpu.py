"""CPU attention backend: every query reads K/V in place from the paged cache, in eyas's C kernel.

Decodes, verification chains and prefill chunks are attended by ``eyas/kernels/paged_attention.c``,
which walks each request's block table and reads K/V straight from the cache: nothing is gathered
or padded. The gather-then-SDPA path copies every request's context, padded to the longest one,
twice per layer (K and V) and then reads the copy again; at batch 32 with 100-400-token contexts on
the project's 2-core CPU that was half of a decode step (150 of 300 ms).

A query row's result depends only on its position and its context, never on the other rows: the
kernel visits a row's keys a cache block at a time, in position order, whatever the query's length.
So how a prompt is chunked, what the prefix cache already held, a preemption's recomputation, and
the batch around a request do not change its outputs (SDPA's blocking follows the query and context
lengths, which moved logits by about 1e-6 between a prefix-cached and an uncached run; enough to flip
a near-tie, and with bfloat16 products, ``matmul_precision="medium"``, one bf16 rounding). Prefill
costs what it did through SDPA, within this host's noise (the default model, 2 threads, AMD Zen 4, best
of 3, two rounds, SDPA first): 16 chat prompts (1,586 tokens) 2.18 / 2.07 s -> 2.16 / 1.82 s, one
1,500-token prompt 2.67 / 2.44 -> 2.68 / 2.38 s, one 3,500-token prompt 8.71 / 7.89 -> 8.19 / 8.28 s.

The same call first writes the step's K/V (of every token) into the cache, and it reads q/k/v
where they lie (views into the fused q/k/v product, each token's heads back to back), so a
layer's attention is one call: at batch 1 a decode step is bound by its count of operations
outside the matrix products (two index_copy_, a copy of q and the kernel took 14 us a layer on
the project's CPU, the one call 6 us).

Kernel inputs per short request n: ``q_start[n]`` (first query row), ``q_len[n]``, ``seq_len[n]``
and ``row[n]`` (its block table row). A flat batch lists its short requests; a uniform layout
(width rows per request, the CUDA-graph layout that draft steps also use on the CPU) lists all,
with ``q_start = b * width``, and leaves padding rows at zero.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from eyas import kernels
from eyas.core.host_ints import host_ints
from eyas.model.attention.base import AttentionBackend, AttentionBatch, UniformBatch, uniform_slots

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load_kernel(isa: str | None = None):
    """The C kernel's entry point, or None where it cannot be built (then the ``sdpa`` backend serves). Built for
    this CPU (``-march=native``); ``isa`` (a key of ``kernels.ISA_BUILDS``) builds it for that instruction set
    alone instead, as on a CPU that has no more (tests)."""
    return kernels.entry("paged_attention", _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, ctypes.c_int, _ptr, _i64,
                         _i64, _i64, ctypes.c_float, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, ctypes.c_int,
                         isa=isa)


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [T] int64 cache slot each new token's K/V goes to
    requests: torch.Tensor  # [4, N] int64 rows q_start, q_len, seq_len, block-table row of each request
    block_table: torch.Tensor  # [B, W] int64, contiguous
    block_size: int
    window: int  # keys a query sees (itself included); 0 = all
    zero_fill: bool  # rows outside every listed request must read 0 (uniform layouts' padding)
    kernel_args: tuple = field(init=False)  # the kernel's arguments that are the same for every layer

    def __post_init__(self):
        self.kernel_args = (self.slot_mapping.data_ptr(), self.slot_mapping.shape[0], self.block_table.data_ptr(),
                            self.block_table.shape[1], self.block_size, self.requests.data_ptr(),
                            self.requests.shape[1], self.window)


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
        starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()  # host ints: a few, one tensor
        requests = host_ints([starts[:-1], [b - a for a, b in zip(starts, starts[1:])], seq_lens,
                              list(range(len(seq_lens)))], (4, len(seq_lens)))
        return CpuMetadata(_int64(batch.slot_mapping), _int64(requests), _int64(batch.block_table), batch.block_size,
                           batch.sliding_window or 0, False)

    def build_uniform_metadata(self, batch: UniformBatch) -> CpuMetadata:
        _, _, slot_mapping = uniform_slots(batch)
        rows = torch.arange(batch.q_lens.shape[0])
        requests = torch.stack([rows * batch.width, batch.q_lens, batch.seq_lens, rows])
        return CpuMetadata(_int64(slot_mapping), _int64(requests), _int64(batch.block_table), batch.block_size,
                           batch.sliding_window or 0, True)

    def forward(self, q, k, v, kv_cache, meta: CpuMetadata):
        num_tokens, num_heads, head_dim = q.shape
        cache_dtype = kv_cache.dtype
        q32 = q.float()
        if k.dtype is not cache_dtype:
            k, v = k.to(cache_dtype), v.to(cache_dtype)
        strides = q32.stride(), k.stride(), v.stride()
        if not strides[0][1:] == strides[1][1:] == strides[2][1:] == (head_dim, 1):  # heads back to back
            q32, k, v = q32.contiguous(), k.contiguous(), v.contiguous()
            strides = q32.stride(), k.stride(), v.stride()
        out = (torch.zeros if meta.zero_fill else torch.empty)(num_tokens, num_heads, head_dim)
        assert kv_cache.is_contiguous()  # [K/V, slots, KVH, D]
        _, num_slots, num_kv_heads, _ = kv_cache.shape
        status = self._kernel(q32.data_ptr(), strides[0][0], k.data_ptr(), strides[1][0], v.data_ptr(), strides[2][0],
                              kv_cache.data_ptr(), num_slots, CACHE_DTYPES[cache_dtype], out.data_ptr(), num_heads,
                              num_kv_heads, head_dim, head_dim ** -0.5, *meta.kernel_args, torch.get_num_threads())
        if status != 0:
            raise MemoryError("paged attention kernel: out of memory for its work buffers")
        return out if q.dtype is torch.float32 else out.to(q.dtype)
