"""Large host buffers (eyas/model/host_memory.py): a KV cache's zeros on lazily zeroed, page-aligned host pages."""

import os

import pytest
import torch

from eyas.model.host_memory import cache_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_zeros_is_a_zero_tensor_of_the_shape_and_dtype_on_a_cache_line(dtype):
    shape = (2, 48, 3, 64)  # [K/V, slots, kv_heads, head_dim]
    caches = [cache_zeros(shape, dtype, "cpu") for _ in range(3)]
    for cache in caches:
        assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
        assert cache.data_ptr() % 64 == 0
        assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    caches[0][1, 5] = 1.5  # each its own storage, writable
    assert caches[0][1, 5].eq(1.5).all() and caches[1].eq(0).all() and caches[0][0].eq(0).all()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc/self/statm")
def test_a_large_cache_takes_memory_only_where_it_is_written():
    """1 GiB of zeros: the pages are mapped, not written (torch.zeros makes them all resident at once)."""
    before = _resident_bytes()
    cache = cache_zeros((2, 1 << 18, 8, 64), torch.float32, "cpu")  # 1 GiB
    cache[1, -1] = 2.0
    assert cache[1, -1].eq(2.0).all() and cache[0, 0].eq(0).all()
    assert _resident_bytes() - before < 64 << 20
