"""``Linear``'s packed oneDNN path: same products as ``F.linear``, and never a stale packed weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.model.layers import _EMULATED_HALF, Linear


@pytest.mark.parametrize("rows", [1, 5, 33, 256, 300])
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
