"""Matmul precision "low" (``eyas/kernels/q8_gemm.c``): activations quantized to int8 per block of 32, integer dot
products on the weights' block integers. Checked against float64 references of the same quantized activations and
the gguf package's dequantized weights, for every format with integers at 1..24 rows; row, batch and thread
invariance; the same bits from every instruction-set build this CPU runs (VNNI 512 and 256, AVX2, portable)."""

import ctypes

import numpy as np
import pytest
import torch
from test_quant_kernels import random_weight

from eyas import kernels
from eyas.model import quantized as Q
from eyas.model.weight_policy import resolve_matmul_precision

pytestmark = pytest.mark.skipif(not Q.kernel_available("low"), reason="no C compiler: the q8 kernel cannot be built")

INTEGER_FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "I8_ROW"]


def weight_of(fmt: str, n: int, k: int, seed: int = 0) -> tuple[Q.QuantWeight, np.ndarray]:
    if fmt == "I8_ROW":
        q = Q.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
        return q, Q.dequantize(q).numpy()
    return random_weight(fmt, n, k, seed)


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 as the kernel quantizes it, written from the definition: per block of 32, d = max|x| / 127
    and q = round-half-even(x * (1 / d)), in float32 -> (d [M, K / 32, 1], q [M, K / 32, 32]), both float32."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d == 0, 1, d), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    assert np.abs(q).max() <= 127
    return d, q


def quantize_reference(x: torch.Tensor) -> np.ndarray:
    """x [M, K] quantized (``quantize_blocks``) -> the float64 values d * q."""
    d, q = quantize_blocks(x.numpy())
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def split_reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] as the split product quantizes it, from the definition: its blocks (``quantize_blocks``) and what
    they leave, r = x - d * q in float32 (the product and the difference each rounded), quantized the same way ->
    the float64 values of both parts."""
    d, q = quantize_blocks(x.numpy())
    r = x.numpy().astype(np.float32).reshape(q.shape) - d * q  # float32 throughout, as the kernel
    dr, qr = quantize_blocks(r.reshape(x.shape))
    return ((q.astype(np.float64) * d).reshape(x.shape), (qr.astype(np.float64) * dr).reshape(x.shape))


def product(x: torch.Tensor, weight: Q.QuantWeight, precision: str = "low", split: bool = False) -> torch.Tensor:
    linear = Q.QuantLinear([weight])
    linear.set_matmul_precision(precision, split=split)
    return linear(x)


@pytest.mark.parametrize("fmt", INTEGER_FORMATS)
def test_products_match_float64_reference_of_the_quantized_activations(fmt):
    """Each output is a float32 sum of per-block terms dx * (sw * i + ow * sx), with i an exact integer: within
    float32 rounding (a few units in the last place per term, over the terms' magnitudes) of the float64 product
    of the same quantized activations and gguf's dequantized weights, at every row count 1..24."""
    k = 768 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 576  # 576: 18 blocks, a partial group of 8 lanes
    weight, w = weight_of(fmt, 37, k)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    xq = quantize_reference(x)
    ref = xq @ w.astype(np.float64).T
    scale = np.abs(xq) @ np.abs(w.astype(np.float64)).T
    for m in range(1, 25):
        out = product(x[:m].contiguous(), weight).double().numpy()
        err = np.abs(out - ref[:m])
        assert (err <= 4e-6 * scale[:m] + 1e-30).all(), (m, err.max(), scale.max())
    # and the quantization error itself is what int8 per block of 32 allows (about 1/254 of each block's max)
    exact = x.double().numpy() @ w.astype(np.float64).T
    assert np.abs(ref - exact).max() <= 0.02 * scale.max()


@pytest.mark.parametrize("fmt", INTEGER_FORMATS)
def test_split_products_match_float64_reference_of_both_quantized_parts(fmt):
    """Split activations (the attention's q/k/v at "low"): each row is the sum of two products in the order above,
    its int8 blocks' and its residual's, so within float32 rounding of the float64 product of both parts; and x is
    then exact to about 2^-16 of each block's max, a hundred times closer than one int8 row."""
    k = 768 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 576
    weight, w = weight_of(fmt, 37, k)
    w = w.astype(np.float64)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0  # an all-zero block: both parts' scales 0
    x[1, 32:64] = 0.5  # a constant block: exact in one int8 row, the residual all zero
    a, b = split_reference(x)
    assert not b[1, 32:64].any()
    ref, scale = (a + b) @ w.T, (np.abs(a) + np.abs(b)) @ np.abs(w).T
    for m in (1, 2, 5, 8, 9, 24):
        out = product(x[:m].contiguous(), weight, split=True).double().numpy()
        assert (np.abs(out - ref[:m]) <= 4e-6 * scale[:m] + 1e-30).all(), m
    exact = x.double().numpy() @ w.T
    one_row = quantize_reference(x) @ w.T
    assert np.abs(ref - exact).max() <= np.abs(one_row - exact).max() / 100


@pytest.mark.parametrize("split", [False, True], ids=["int8", "split"])
@pytest.mark.parametrize("fmt", INTEGER_FORMATS)
def test_row_results_do_not_depend_on_batch_rows_or_threads(fmt, split):
    weight, _ = weight_of(fmt, 45, 512)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = product(x, weight, split=split)
        torch.set_num_threads(1)
        assert torch.equal(product(x, weight, split=split), full)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 1, 7, 39):
        assert torch.equal(product(x[i:i + 1].contiguous(), weight, split=split), full[i:i + 1])
        assert torch.equal(product(x[i - 1 if i else 0:i + 4].contiguous(), weight, split=split)[1 if i else 0],
                           full[i])
    weight, _ = weight_of(fmt, 45, 512)  # in GGUF row order again ("low" interleaves Q4_0 / Q4_1 / Q8_0 in place)
    rows = Q.QuantLinear([Q.QuantWeight(weight.data[5:17].contiguous(), weight.fmt, 512,
                                        None if weight.scale is None else weight.scale[5:17].contiguous())])
    rows.set_matmul_precision("low", split=split)
    assert torch.equal(rows(x), full[:, 5:17])  # a row's result does not depend on the weight's other rows


def _builds() -> list[tuple[str, str | None]]:
    """Every (instruction set, variant) build of q8_gemm.c this CPU runs."""
    flags = kernels.cpu_flags()
    out = []
    for isa in kernels.supported_isas():
        out.append((isa, None))
        out += [(isa, v) for v, (name, v_isa, needs, _) in kernels.VARIANTS.items()
                if name == "q8_gemm" and v_isa == isa and all(f in flags for f in needs)]
    return out


def _run(fn, x: torch.Tensor, weight: Q.QuantWeight) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.out_features)
    scale = None if weight.scale is None else weight.scale.data_ptr()
    assert fn(x.data_ptr(), x.shape[1], weight.data.data_ptr(), weight.fmt.type_id, scale, out.data_ptr(),
              weight.out_features, x.shape[0], weight.out_features, x.shape[1], 2) == 0
    return out


def test_every_instruction_set_build_gives_the_same_bits():
    """vpdpbusd (512- and 256-bit forms), vpmaddubsw + vpmaddwd and C loops make the same integers, and the float
    sums run in one order in every build: the outputs are equal bit for bit."""
    builds = _builds()
    assert ("portable", None) in builds
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(5)) * 3
    for fmt in INTEGER_FORMATS:
        weight, _ = weight_of(fmt, 19, 768, seed=2)
        for split in (False, True):
            results = {b: _run(Q.q8_kernel(*b, split), x, weight) for b in builds}
            first = results[builds[0]]
            assert all(torch.equal(r, first) for r in results.values()), (fmt, split, builds)


def test_the_engine_takes_the_vnni_build_where_the_cpu_has_it():
    flags = kernels.cpu_flags()
    variant = kernels.dot_variant("q8_gemm")
    if kernels.cpu_isa() == "avx512" and {"avx512_vnni", "amx_tile", "amx_int8"} <= flags:
        assert variant == "amx" and Q.dot_products().startswith("AVX512-VNNI vpdpbusd")
    elif kernels.cpu_isa() == "avx512" and "avx512_vnni" in flags:
        assert variant == "vnni512" and Q.dot_products() == "AVX512-VNNI vpdpbusd"
    elif kernels.cpu_isa() == "avx2" and "avx_vnni" in flags:
        assert variant == "vnni256"
    else:
        assert variant is None


@pytest.mark.skipif(not kernels.variant_supported("amx"), reason="no AMX-INT8 on this CPU")
def test_a_compiler_without_amx_keeps_the_vnni_build(monkeypatch):
    """GCC before 11 has no -mamx-int8: the amx build fails and an AMX CPU takes vnni512, not no "low" at all."""
    library = kernels._library
    monkeypatch.setattr(kernels, "_library", lambda name, cc, isa, variant:
                        None if variant == "amx" else library(name, cc, isa, variant))
    assert kernels.dot_variant("q8_gemm") == "vnni512"


def test_float_formats_stay_on_float_products_and_mixed_parts_fill_their_columns():
    """F16 / BF16 hold no integers: at "low" they keep the float32 products; a fused weight of a Q4_K and a BF16
    part computes each part its own way into its own columns."""
    (a, _), (b, _) = random_weight("Q4_K", 8, 256), random_weight("BF16", 4, 256, seed=2)
    x = torch.randn(3, 256)
    fused = Q.QuantLinear.stacked([a, b])
    fused.set_matmul_precision("low")
    out = fused(x)
    assert torch.equal(out[:, :8], product(x, a)) and torch.equal(out[:, 8:], product(x, b, "highest"))
    q8 = Q.q8_kernel(kernels.cpu_isa(), kernels.dot_variant("q8_gemm"))
    assert q8(x.data_ptr(), 256, b.data.data_ptr(), b.fmt.type_id, None, out.data_ptr(), 12, 3, 4, 256, 1) == -2


def test_quantized_activations_equal_the_definition():
    """The kernel's own quantization (eyas_q8_quantize) gives the reference's d and q exactly, half-way cases
    rounded to even."""
    fn = kernels.entry("q8_gemm", *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] +
                       [ctypes.c_void_p] * 3, function="q8_quantize", isa=kernels.cpu_isa(),
                       variant=kernels.dot_variant("q8_gemm"))
    x = torch.randn(3, 64)
    x[1, :32] = torch.arange(32) - 16.0 + 0.5  # d = 15.5 / 127 exactly a ratio: ties at x / d = k + 0.5
    qx, dx, sx = torch.empty(3, 64, dtype=torch.int8), torch.empty(3, 8), torch.empty(3, 8)  # 2 blocks, padded to 8
    assert fn(x.data_ptr(), 64, 3, 64, qx.data_ptr(), dx.data_ptr(), sx.data_ptr()) == 0
    assert not dx[:, 2:].any() and not sx[:, 2:].any()
    dx, sx = dx[:, :2], sx[:, :2]
    assert np.array_equal((qx.double() * dx.double().repeat_interleave(32, 1)).numpy(), quantize_reference(x))
    assert torch.equal(sx, qx.view(3, 2, 32).sum(2).float())


def test_low_precision_is_resolved_at_the_edge():
    assert resolve_matmul_precision("low", "gguf")[0] == "low"
    with pytest.raises(ValueError, match="'low' applies to eyas's CPU kernels"):
        resolve_matmul_precision("low", None)
    with pytest.raises(ValueError, match="matmul_precision: 'lowest' is not one of 'auto', 'highest', 'medium', 'low'"):
        resolve_matmul_precision("lowest", "gguf")
