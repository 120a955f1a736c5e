"""Large host buffers: zero-filled mappings whose pages the OS zeroes as they are first written, the weights' on
transparent huge pages.

A decode step streams every weight once: on 4 KiB pages the 96 MB of the default GGUF model span 24,000 pages,
more than the TLB holds. On Linux a private anonymous mapping with ``MADV_HUGEPAGE`` gets 2 MiB pages where the
kernel has them (most distributions enable transparent huge pages only where asked: "madvise"); elsewhere the
buffer is an ordinary allocation. The mapping is zero-filled, and the tensor keeps it alive.

Measured on a Zen 4 guest (``benchmarks/README.md``): batch-1 decoding of the default model on one thread went from
118-120 to 129-131 tok/s with its weights on huge pages (``eyas.model.quantized.Arena``). The KV cache gained 1% at
batch 16 and stays on ordinary pages (``cache_zeros``): its blocks are used anywhere in it, and a huge page is
resident whole once any of it is written.

A KV cache is a mapping too, so it costs no time and no memory until its slots are used: ``torch.zeros`` writes every
byte at once, 0.27 s of start-up for the default 1 GiB cache on one Zen 4 core, and that much resident memory from
the first moment. Zeros, not uninitialised memory: the attention kernel reads the hidden keys of a partly visible
chunk at weight 0, and 0 times a stale NaN would be NaN.
"""

from __future__ import annotations

import math
import mmap

import torch


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` on a private anonymous mapping (page-aligned; pages zeroed by the OS
    on first write), on huge pages where asked and the OS gives them; an ordinary ``torch.zeros`` where there is no
    such mapping."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MAP_ANONYMOUS") or not nbytes:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shared: shmem has none
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A KV cache's (or a cache-only store's) zero storage: on the host ``host_zeros`` on ordinary pages, elsewhere
    ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return host_zeros(shape, dtype, huge_pages=False)
