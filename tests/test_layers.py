"""``Linear``'s native paths (eyas's small-row kernel, oneDNN's packed weight): the products of ``F.linear``,
batch- and thread-invariant where promised, and never a stale packed weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import without_c_compiler

from eyas.model import layers
from eyas.model.layers import _EMULATED_HALF, Linear


@pytest.mark.parametrize("rows", [1, 5, 24, 25, 33, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_weight_changes_are_seen():
    layer = Linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), 2 * first, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # replaced
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        layer.load_state_dict({"weight": torch.ones(32, 64)})  # copy_ under inference mode keeps the tensor
        torch.testing.assert_close(layer(x), x.sum(1, keepdim=True).expand(3, 32), rtol=1e-5, atol=1e-5)


def test_autograd_takes_the_plain_path():
    layer = Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 300])
def test_half_precision_products_are_float32_sums_rounded_once(dtype, rows):
    """Whichever path a half-precision product takes, it is the float32 sum of the exact products,
    rounded once to the weight's dtype (what a native half-precision GEMM computes)."""
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=True).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    if dtype in _EMULATED_HALF:  # one row keeps PyTorch's half-precision GEMV; more take the packed copy
        assert (layer._packed is not None) == (rows >= 2)


@pytest.mark.parametrize("in_features, out_features", [(13, 7), (64, 5), (96, 80), (576, 97)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 24])
def test_small_kernel_matches_a_float64_reference(in_features, out_features, rows):
    """Every tile shape of the kernel (1-4 weight rows, 1-3 input rows, a K % 8 tail) against float64."""
    assert layers._small_gemm_kernel() is not None, "the test machine has a C compiler"
    gen = torch.Generator().manual_seed(in_features * rows)
    layer = Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    with torch.inference_mode():
        assert layer._takes_small(x)
        got = layer(x)
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    assert layer._packed is None  # the kernel reads the weight in place


def test_small_kernel_is_batch_and_thread_invariant():
    """A row's product has the same bits alone or among other rows, on any thread count."""
    gen = torch.Generator().manual_seed(0)
    layer = Linear(576, 201, bias=False)
    x = torch.randn(24, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(2)
            batch = layer(x)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
            torch.set_num_threads(1)
            one_thread = layer(x)
            torch.set_num_threads(3)
            three_threads = layer(x[5:14])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, alone) and torch.equal(batch, one_thread) and torch.equal(batch[5:14], three_threads)


def test_without_a_c_compiler_small_products_take_the_packed_path(monkeypatch, tmp_path):
    with without_c_compiler(monkeypatch, tmp_path, layers._small_gemm_kernel):
        layer = Linear(32, 16, bias=True)
        x = torch.randn(3, 32)
        with torch.inference_mode():
            assert not layer._takes_small(x)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer._packed is not None
