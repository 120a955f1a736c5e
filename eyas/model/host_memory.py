"""Large host buffers on transparent huge pages.

A decode step streams every weight once: on 4 KiB pages the 96 MB of the default GGUF model span 24,000 pages,
more than the TLB holds. On Linux a private anonymous mapping with ``MADV_HUGEPAGE`` gets 2 MiB pages where the
kernel has them (most distributions enable transparent huge pages only where asked: "madvise"); elsewhere the
buffer is an ordinary allocation. The mapping is zero-filled, and the tensor keeps it alive.

Measured on a Zen 4 guest (``benchmarks/README.md``): batch-1 decoding of the default model on one thread went from
118-120 to 129-131 tok/s with its weights on huge pages (``eyas.model.quantized.Arena``). The KV cache gained 1% at
batch 16 and stays on ordinary pages.
"""

from __future__ import annotations

import math
import mmap

import torch


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape``, on huge pages where the OS gives them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or not nbytes:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shared: shmem has none
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)
