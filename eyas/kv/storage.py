"""Cache storage: zero-filled tensors for the KV caches (and a drafter's cache-only stores).

On the host the zeros come from pages the operating system maps zeroed and fills on first write (NumPy's
``np.zeros`` is ``calloc``, which takes fresh pages from ``mmap`` for a large block), so a cache costs no time and
no memory until its slots are used: ``torch.zeros`` writes every byte at once, 0.27 s of start-up for the default
1 GiB cache on one Zen 4 core, and that much resident memory from the first moment. The storage starts on a 64-byte
line, as the allocator's own does (a 16-byte start would split every vector load of a K/V row across two lines).
Zeros, not uninitialised memory: the attention kernel reads the hidden keys of a partly visible chunk at weight 0,
and 0 times a stale NaN would be NaN. Elsewhere (CUDA) it is ``torch.zeros``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LINE = 64  # bytes


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of ``shape`` and ``dtype`` on ``device`` (see the module docstring)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + LINE, dtype=np.uint8)
    start = -raw.ctypes.data % LINE
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
