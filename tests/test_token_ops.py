"""RMSNorm, the rotary embedding and the SiLU gate through ``eyas/kernels/token_ops.c`` against PyTorch's
unfused ops: bit for bit where the arithmetic is the same (rotary), else within stated tolerances, and
thread- and batch-invariant; autograd and a machine without a C compiler take PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import without_c_compiler

from eyas.model import layers
from eyas.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul

ROWS = [1, 3, 40, 300]  # 300 rows of 576 or more take the kernel's threaded loop


@pytest.fixture
def threads():
    """Set the thread count inside a test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _torch_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_the_kernel_builds_here():
    assert layers._token_ops() is not None, "the test machine has a C compiler"


@pytest.mark.parametrize("size", [8, 13, 64, 576, 2048])
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_rms_norm_matches_pytorch_and_float64(size, rows):
    """Only the order of the sum of squares differs from PyTorch's: a few units in the last place."""
    gen = torch.Generator().manual_seed(size * rows)
    norm = RMSNorm(size, 1e-5)
    norm.weight.copy_(torch.randn(size, generator=gen))
    x = torch.randn(rows, size, generator=gen) * 3
    got = norm(x)
    torch.testing.assert_close(got, F.rms_norm(x, (size,), norm.weight, 1e-5), rtol=4e-7, atol=1e-7)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(got.double(), want, rtol=5e-7, atol=1e-7)


@torch.inference_mode()
def test_rms_norm_of_views_and_3d_inputs():
    """Per-head norms (Qwen3's q/k norm) get [T, heads, D] views of a wider tensor."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    qkv = torch.randn(5, 12, 16, generator=gen)
    q = qkv[:, :8]  # [5, 8, 16], not contiguous
    torch.testing.assert_close(norm(q), F.rms_norm(q, (16,), norm.weight, 1e-6), rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("head_dim", [8, 20, 64, 128])
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_rotary_equals_pytorch_bit_for_bit(head_dim, rows):
    """q and k heads as the model passes them: a view of the fused q/k/v product (token stride past the heads)."""
    gen = torch.Generator().manual_seed(head_dim + rows)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rotary.table(torch.randint(0, 4096, (rows,), generator=gen), torch.float32)
    qkv = torch.randn(rows, 15, head_dim, generator=gen)
    qk = qkv[:, :12]  # [T, 12, D]
    got = apply_rotary(qk, cos, sin)
    assert got.is_contiguous() and torch.equal(got, _torch_rotary(qk, cos, sin))
    heads_apart = torch.randn(12, rows, head_dim, generator=gen).transpose(0, 1)  # [T, 12, D], copied first
    assert torch.equal(apply_rotary(heads_apart, cos, sin), _torch_rotary(heads_apart, cos, sin))


@pytest.mark.parametrize("width", [5, 8, 13, 1536])
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_silu_and_mul_matches_pytorch(width, rows):
    """The kernel's exp is within 1 ulp, as PyTorch's vectorised one is: products within 4 ulp of float64
    (PyTorch's own are within 2 here), inputs from -100 to 100 (exp(-g) past float's range included)."""
    gen = torch.Generator().manual_seed(width * rows)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 30
    got = silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=5e-7, atol=1e-30)
    want = gate.double() * torch.sigmoid(gate.double()) * up.double()
    assert ((got.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * want.abs() + 1e-30).all()


@torch.inference_mode()
def test_results_do_not_depend_on_threads_or_batch(threads):
    """A row computed alone, in a batch, on 1 or 2 threads: the same bits (the threaded loop included)."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.copy_(torch.randn(576, generator=gen))
    rotary = RotaryEmbedding(64, 1024, 10000.0, None)
    x = torch.randn(300, 576, generator=gen)
    qk = torch.randn(300, 12, 64, generator=gen)
    cos, sin = rotary.table(torch.arange(300), torch.float32)
    gate_up = torch.randn(300, 3072, generator=gen)

    def run():
        return norm(x), apply_rotary(qk, cos, sin), silu_and_mul(gate_up)

    threads(1)
    one = run()
    alone = norm(x[7:8]), apply_rotary(qk[7:8], cos[7:8], sin[7:8]), silu_and_mul(gate_up[7:8])
    threads(2)
    two = run()
    for a, b, c in zip(one, two, alone):
        assert torch.equal(a, b) and torch.equal(a[7:8], c)


def test_autograd_takes_pytorch_ops():
    norm = RMSNorm(32, 1e-5)
    x = torch.randn(4, 32, requires_grad=True)
    cos, sin = RotaryEmbedding(32, 16, 10000.0, None).table(torch.arange(4), torch.float32)
    out = silu_and_mul(torch.cat([norm(x), norm(x)], dim=-1)).sum() + apply_rotary(x.view(4, 1, 32), cos, sin).sum()
    out.backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_without_a_c_compiler_pytorch_ops_serve(monkeypatch, tmp_path):
    with without_c_compiler(monkeypatch, tmp_path, layers._token_ops):
        assert layers._token_ops() is None
        norm = RMSNorm(24, 1e-5)
        x = torch.randn(3, 24)
        cos, sin = RotaryEmbedding(8, 16, 10000.0, None).table(torch.arange(3), torch.float32)
        with torch.inference_mode():
            assert torch.equal(norm(x), F.rms_norm(x, (24,), norm.weight, 1e-5))
            assert torch.equal(apply_rotary(x.view(3, 3, 8), cos, sin), _torch_rotary(x.view(3, 3, 8), cos, sin))
            gate, up = x.chunk(2, dim=-1)
            assert torch.equal(silu_and_mul(x), F.silu(gate) * up)
