"""RMSNorm, the rotary embedding, the SiLU gate and the sampling reductions (argmax, Gumbel-max, a row's
best values, the log_softmax over the values above a floor) through ``eyas/kernels/token_ops.c`` against
PyTorch's unfused ops: bit for bit where the arithmetic is the same (rotary, the reductions), else within
stated tolerances, and thread- and batch-invariant; autograd and a machine without a C compiler take
PyTorch's ops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import without_c_compiler

from eyas.kernels import token_ops
from eyas.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul
from eyas.sampling.noise import gumbel
from eyas.sampling.row_ops import argmax, gumbel_argmax, log_normaliser, log_softmax_above_, top_values

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
    assert token_ops.token_ops() is not None, "the test machine has a C compiler"


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


@pytest.mark.parametrize("width", [1, 5, 16, 17, 47, 64, 100, 177, 49152])
@torch.inference_mode()
def test_argmax_equals_pytorch_with_ties_infinities_and_nans(width, threads):
    """The first of equal values, whether they fall in one lane, in two lanes or accumulators, or in the tail; rows of
    -inf (a fully masked row); a NaN anywhere wins, the first one; -0.0 ties 0.0. 1 and 2 threads, alone
    and in a batch of 300 rows (the threaded loop)."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(300, width, generator=gen).round(decimals=1)  # many exact ties
    x[1] = -math.inf
    x[2] = 7.0  # every value equal
    x[3, width // 2:] = 9.0  # the first of a run of maxima, across lanes and the tail
    x[4, -1] = 9.0  # the maximum last (in the tail when width % 16)
    x[5, width // 3] = math.nan
    x[6, width // 4:] = math.nan
    x[7, width // 2] = math.inf
    x[8] = 0.0
    x[8, width - 1] = -0.0
    x[9, 1:] = -math.inf  # the maximum first
    want = x.argmax(dim=-1)
    threads(1)
    assert torch.equal(argmax(x), want)
    assert all(int(argmax(x[r:r + 1])[0]) == want[r] for r in range(12))
    threads(2)
    assert torch.equal(argmax(x), want)
    assert torch.equal(argmax(x[:, : max(1, width - 1)]), x[:, : max(1, width - 1)].argmax(dim=-1))  # a view


@pytest.mark.parametrize("width,n", [(1, 16), (2, 17), (64, 49152), (100, 1000), (1024, 49152), (6, 48)])
@torch.inference_mode()
def test_top_values_equal_pytorch_topk(width, n, threads):
    """Ties, rows of -inf, -inf among values, a row of equal values, 1 and 2 threads, alone and in 40 rows;
    a NaN goes back to PyTorch, which places it."""
    gen = torch.Generator().manual_seed(n + width)
    x = (torch.randn(40, n, generator=gen) * 4).round()  # many ties
    x[1] = -math.inf
    x[2, ::3] = -math.inf
    x[3] = 2.0
    x[4] = torch.arange(n, dtype=torch.float32)  # ascending: every value enters the heap
    want = torch.topk(x, width, dim=-1).values
    for t in (1, 2):
        threads(t)
        assert torch.equal(top_values(x, width), want)
    assert torch.equal(top_values(x[4:5], width), want[4:5])
    x[5, n // 2] = math.nan
    assert torch.equal(top_values(x, width).nan_to_num(), torch.topk(x, width, dim=-1).values.nan_to_num())


def _masked_log_softmax(x, floor):
    """The formula from PyTorch's own ops, in float64: values below the floor masked, then log_softmax."""
    return torch.log_softmax(x.double().masked_fill(x < floor, -math.inf), dim=-1)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 47, 49152])
@torch.inference_mode()
def test_log_softmax_above_matches_pytorch(n, threads):
    """Rows of logits at temperature 0.2 (most values more than 87 below the best: exp gives 0 there) and 1,
    floors of -inf and inside the row, -inf among the values; a row of -inf, a row whose floor is above
    every value, a NaN and a +inf give NaN rows as PyTorch's formula does. 1 and 2 threads, alone and in 40
    rows: the same bits."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(40, n, generator=gen) * 3
    x[:20] /= 0.2
    floor = torch.full((40, 1), -math.inf)
    floor[10:30, 0] = x[10:30].quantile(0.7, dim=-1)  # about 30% kept
    x[5, 1::3] = -math.inf
    x[30] = -math.inf
    floor[31, 0] = x[31].max() + 1
    x[32, n // 2] = math.nan
    x[33, n // 3] = math.inf
    want = _masked_log_softmax(x, floor)
    got, z = [], []
    for t in (1, 2):
        threads(t)
        got.append(log_softmax_above_(x.clone(), floor).nan_to_num())
        z.append(log_normaliser(x, floor).nan_to_num())
    assert torch.equal(got[0], got[1]) and torch.equal(got[0][7:8], log_softmax_above_(x[7:8].clone(), floor[7:8]))
    assert torch.equal(z[0], z[1]) and torch.equal(z[0][12:13], log_normaliser(x[12:13], floor[12:13]))
    got = log_softmax_above_(x.clone(), floor)
    good = [r for r in range(40) if r not in (30, 31, 32, 33)]
    assert torch.equal(got[good].isinf(), want[good].isinf())  # the same values kept
    torch.testing.assert_close(got[good].double(), want[good], rtol=1e-6, atol=2e-5)
    assert got[[30, 31, 32, 33]].isnan().all() and want[[30, 31, 32, 33]].isnan().all()
    z = log_normaliser(x, floor).double()  # [40, 1]
    torch.testing.assert_close(z[good], torch.logsumexp(x.double().masked_fill(x < floor, -math.inf), -1,
                                                        keepdim=True)[good], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(log_normaliser(x[good]).double(), torch.logsumexp(x[good].double(), -1, keepdim=True),
                               rtol=1e-6, atol=1e-5)


def test_autograd_takes_pytorch_ops():
    norm = RMSNorm(32, 1e-5)
    x = torch.randn(4, 32, requires_grad=True)
    cos, sin = RotaryEmbedding(32, 16, 10000.0, None).table(torch.arange(4), torch.float32)
    out = silu_and_mul(torch.cat([norm(x), norm(x)], dim=-1)).sum() + apply_rotary(x.view(4, 1, 32), cos, sin).sum()
    out.backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_without_a_c_compiler_pytorch_ops_serve(monkeypatch, tmp_path):
    with without_c_compiler(monkeypatch, tmp_path, token_ops.token_ops):
        assert token_ops.token_ops() is None
        norm = RMSNorm(24, 1e-5)
        x = torch.randn(3, 24)
        cos, sin = RotaryEmbedding(8, 16, 10000.0, None).table(torch.arange(3), torch.float32)
        with torch.inference_mode():
            assert torch.equal(norm(x), F.rms_norm(x, (24,), norm.weight, 1e-5))
            assert torch.equal(apply_rotary(x.view(3, 3, 8), cos, sin), _torch_rotary(x.view(3, 3, 8), cos, sin))
            gate, up = x.chunk(2, dim=-1)
            assert torch.equal(silu_and_mul(x), F.silu(gate) * up)
            assert torch.equal(argmax(x), x.argmax(dim=-1))
            seeds = torch.arange(3)
            assert torch.equal(gumbel_argmax(x, seeds, seeds), (gumbel(seeds, seeds, 24) + x).argmax(dim=-1))
            floor = x.median(dim=-1, keepdim=True).values
            torch.testing.assert_close(log_softmax_above_(x.clone(), floor).double(), _masked_log_softmax(x, floor))
            torch.testing.assert_close(log_normaliser(x, floor), torch.logsumexp(x.masked_fill(x < floor, -math.inf),
                                                                                 -1, keepdim=True))
