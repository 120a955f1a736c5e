"""eyas's quantized CPU kernel (``eyas/kernels/quant_gemm.c``) against float64 references built from
the ``gguf`` package's own dequantization: every block format, tile-edge shapes, 1..300 rows, batch
and thread invariance, and each instruction-set build this CPU runs; at matmul precision "medium"
(bfloat16 products), against the reference of the bf16-rounded activations and weights."""

import os
import time

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from kernel_helpers import without_c_compiler

from eyas import kernels
from eyas.model import quantized as Q

pytestmark = pytest.mark.skipif(not Q.kernel_available(), reason="no C compiler: the quantized kernel cannot be built")

GGML_FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]
# (offset, size) of the float16 scale fields inside one block, set to values that keep |w| near 0.1 (random
# bytes could be inf/NaN, or make a random model's logits explode)
_HALF_FIELDS = {"Q4_0": ((0, 0.1 / 8),), "Q4_1": ((0, 0.1 / 15), (2, 0.05)), "Q8_0": ((0, 0.1 / 127),),
                "Q4_K": ((0, 0.1 / 945), (2, 0.05 / 63)), "Q5_K": ((0, 0.1 / 1953), (2, 0.05 / 63)),
                "Q6_K": ((208, 0.1 / 4064),)}
NEEDS_MEDIUM = pytest.mark.skipif(not Q.kernel_available("medium"),
                                  reason="no AVX512-BF16 here: matmul precision 'medium' does not run")
PRECISIONS = ["highest", pytest.param("medium", marks=NEEDS_MEDIUM)]


def random_weight(fmt_name: str, n: int, k: int, seed: int = 0) -> tuple[Q.QuantWeight, np.ndarray]:
    """A random [n, k] weight in the format and its float32 dequantization by the gguf package."""
    rng = np.random.default_rng(seed)
    fmt = Q.FORMATS[fmt_name]
    if fmt_name == "F16":
        values = (rng.standard_normal((n, k)) * 0.05).astype(np.float16)
        return Q.QuantWeight(torch.from_numpy(values.view(np.uint8).copy()), fmt, k), values.astype(np.float32)
    if fmt_name == "BF16":
        values = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)
        return Q.QuantWeight(values.view(torch.uint8).clone(), fmt, k), values.float().numpy()
    blocks = rng.integers(0, 256, size=(n, k // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    for offset, size in _HALF_FIELDS[fmt_name]:
        scale = (rng.standard_normal((n, k // fmt.block_size, 1)) * size).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8)
    data = blocks.reshape(n, -1)
    reference = gguf_dequantize(data, GGMLQuantizationType[fmt_name]).astype(np.float32)
    return Q.QuantWeight(torch.from_numpy(data.copy()), fmt, k), reference


def product(x: torch.Tensor, weight: Q.QuantWeight, precision: str = "highest") -> torch.Tensor:
    """x @ weight^T through the layer the model uses."""
    linear = Q.QuantLinear([weight])
    linear.set_matmul_precision(precision)
    return linear(x)


def check_close(out: torch.Tensor, x: torch.Tensor, w: np.ndarray, precision: str = "highest"):
    """out against x @ w^T in float64 (at "medium", of x and w rounded to bfloat16 first, to nearest even: the
    products are then exact, only their float32 sums round); the bound is float32 accumulation error over the
    terms' magnitudes. The bf16 roundings themselves move a product by about 1e-3 of its scale, far past it."""
    w = torch.from_numpy(w)
    if precision == "medium":
        x, w = x.bfloat16(), w.bfloat16()
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-30).all(), f"max error {err.max():.3g}, at scale {scale.max():.3g}"


@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_dequantized_rows_equal_gguf(fmt):
    k = 512 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 96
    weight, reference = random_weight(fmt, 13, k)
    assert torch.equal(Q.dequantize(weight), torch.from_numpy(reference))
    rows = torch.tensor([12, 0, 5, 5])
    assert torch.equal(Q.dequantize_rows(weight, rows), torch.from_numpy(reference[rows.numpy()]))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fmt", GGML_FORMATS)
@pytest.mark.parametrize("n,k", [(1, 256), (5, 512), (17, 768)])
def test_products_match_float64_reference(fmt, n, k, precision):
    weight, reference = random_weight(fmt, n, k, seed=n)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
    for rows in (1, 2, 3, 4, 5, 7, 16, 25, 300):
        check_close(product(x[:rows].contiguous(), weight, precision), x[:rows], reference, precision)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "BF16"])
def test_blocks_of_32_need_no_multiple_of_256(fmt):
    weight, reference = random_weight(fmt, 6, 32 * 7)  # 224: no whole super-block
    x = torch.randn(3, 224)
    check_close(product(x, weight), x, reference)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_row_results_do_not_depend_on_batch_or_threads(fmt, precision):
    # 263 weight rows: several panels per thread and a partial tile when all 300 rows come at once (x over the
    # kernel's PANEL_MIN_X_BYTES), tile by tile for a few rows
    weight, _ = random_weight(fmt, 263, 512)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = product(x, weight, precision)
        torch.set_num_threads(1)
        assert torch.equal(product(x, weight, precision), full)  # thread count
    finally:
        torch.set_num_threads(threads)
    for i in (0, 1, 2, 3, 150, 295):  # alone, and among a few other rows
        assert torch.equal(product(x[i:i + 1].contiguous(), weight, precision), full[i:i + 1])
        assert torch.equal(product(x[i:i + 5].contiguous(), weight, precision)[0], full[i])
    # as one part of a fused weight whose other part is in another format: each fills its own columns
    other = random_weight("Q4_0" if fmt == "Q8_0" else "Q8_0", 6, 512, seed=4)[0]
    fused = Q.QuantLinear.stacked([weight, other])
    fused.set_matmul_precision(precision)
    fused = fused(x)
    assert torch.equal(fused[:, :263], full) and torch.equal(fused[:, 263:], product(x, other, precision))


@pytest.mark.parametrize("isa", kernels.supported_isas())
def test_every_instruction_set_gives_the_same_bits(isa, monkeypatch):
    """Each build this CPU runs (forced with EYAS_CPU_ISA) equals the default one exactly, for a few rows (tile
    by tile) and for 300 (panels)."""
    weights = {fmt: random_weight(fmt, 9, 512, seed=1)[0] for fmt in GGML_FORMATS}
    weights["I8_ROW"] = Q.quantize_int8(torch.randn(9, 512))
    xs = torch.randn(7, 512), torch.randn(300, 512)
    expected = {fmt: [product(x, w) for x in xs] for fmt, w in weights.items()}
    dense = {fmt: Q.dequantize(w) for fmt, w in weights.items()}
    monkeypatch.setenv("EYAS_CPU_ISA", isa)
    assert kernels.cpu_isa() == isa
    for fmt, w in weights.items():
        assert all(torch.equal(product(x, w), e) for x, e in zip(xs, expected[fmt])), (isa, fmt)
        assert torch.equal(Q.dequantize(w), dense[fmt]), (isa, fmt)


def test_dispatch_picks_the_best_instruction_set_and_refuses_a_missing_one(monkeypatch):
    flags = kernels.cpu_flags()
    best = kernels.supported_isas()[0]
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert best == "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert best == "avx2"
    else:
        assert best == "portable"
    monkeypatch.delenv("EYAS_CPU_ISA", raising=False)
    assert kernels.cpu_isa() == best
    monkeypatch.setenv("EYAS_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="EYAS_CPU_ISA='sse9': this CPU runs"):
        kernels.cpu_isa()


def test_an_avx2_only_cpu_takes_the_avx2_build(monkeypatch):
    """The dispatch reads /proc/cpuinfo's flags: an AVX2 CPU without AVX512 gets the AVX2 build."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    kernels.supported_isas.cache_clear()
    try:
        assert kernels.supported_isas() == ("avx2", "portable")
        assert kernels.cpu_isa() == "avx2"
    finally:
        kernels.supported_isas.cache_clear()



def test_building_builds_the_libraries_the_engine_loads_and_nothing_without_a_compiler(monkeypatch, tmp_path):
    """``kernels.building`` (around an engine's first step on a CPU) fills an empty cache with one library per kernel
    an engine may load: afterwards loading each builds nothing more. Without a C compiler it builds nothing and
    raises nothing (the loads say why, later)."""
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "cache"))
    with kernels.building():
        pass
    built = sorted((tmp_path / "cache" / "kernels").glob("*.so"))
    builds = kernels.engine_builds()
    assert len(built) == len(builds)
    assert {p.name.rsplit("-", 1)[0] for p in built} == {name for name, _, _ in builds} >= {"quant_gemm", "token_ops"}
    kernels.load.cache_clear()
    try:
        assert all(kernels.load(*build) is not None for build in builds)
    finally:
        kernels.load.cache_clear()
    assert sorted((tmp_path / "cache" / "kernels").glob("*.so")) == built
    with without_c_compiler(monkeypatch, tmp_path):
        with kernels.building():
            pass
        assert not (tmp_path / "kernel-cache").exists()

def test_an_error_inside_building_is_raised_at_once_and_cancels_the_builds_not_started(monkeypatch):
    """An engine that fails to resolve its model (a wrong name) says so without waiting for every kernel build:
    on one core the first build runs on, the others never start."""
    started = []

    def slow_build(name, *args):
        started.append(name)
        time.sleep(0.5)

    monkeypatch.setattr(kernels, "_library", slow_build)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    begin = time.perf_counter()
    with pytest.raises(ValueError, match="no such model"), kernels.building():
        raise ValueError("no such model")
    assert time.perf_counter() - begin < 0.4
    time.sleep(1.0)
    assert started == ["quant_gemm"]


def test_building_starts_the_variants_last_and_an_engine_that_will_not_run_one_leaves_it_out(monkeypatch):
    """The default GGUF on a VNNI CPU runs "low": its first run leaves out quant_gemm.c's bfloat16 build (about a
    third of the builds' time on 2 cores), which nothing it loads needs."""
    ran = []

    def build(name, cc, isa, variant):
        ran.append((name, variant))
        time.sleep(0.05)

    monkeypatch.setattr(kernels, "_library", build)
    monkeypatch.setattr(kernels, "dot_variant", lambda name: None)
    monkeypatch.setattr(kernels, "variant_supported", lambda variant: variant == "bf16_products")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with kernels.building() as builds:
        builds.skip("bf16_products")
    assert ("quant_gemm", "bf16_products") not in ran and ran[:2] == [("quant_gemm", None), ("q8_gemm", None)]
    assert {name for name, _ in ran} == {p.stem for p in kernels._SOURCES.glob("*.c")}
    ran.clear()
    with kernels.building():
        pass
    assert ran[-1] == ("quant_gemm", "bf16_products")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_int8_rows_round_trip_and_products(precision):
    w = torch.randn(40, 576)
    w[3] = 0  # an all-zero row gets scale 0, not a division by zero
    q = Q.quantize_int8(w)
    back = Q.dequantize(q)
    assert (back - w).abs().max(dim=1).values.le(q.scale * (0.5 + 1e-4)).all()  # + the rounding of q * scale
    assert torch.equal(back[3], torch.zeros(576))
    x = torch.randn(5, 576)
    if precision == "medium":  # x already bfloat16, so only the sums round: the int8 values are bf16 exactly, and
        x = x.bfloat16().float()  # the row scale multiplies the sum
    check_close(product(x, q, precision), x, back.numpy())


def test_q8_0_blocks_made_from_floats_are_the_gguf_definition():
    """quantize_q8_0 writes GGUF Q8_0 rows: per block of 32 a float16 d = max|w| / 127, then q = round(w / d) with
    that d; dequantizing gives d * q, within half a step of w, and an all-zero block stays zero."""
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(3)) * 4
    w[2, 32:64] = 0
    q = Q.quantize_q8_0(w)
    assert q.fmt.name == "Q8_0" and q.data.shape == (6, 3 * 34)
    records = q.data.view(6, 3, 34)
    d = records[:, :, :2].contiguous().view(torch.float16).float().squeeze(-1)  # [6, 3]
    qs = records[:, :, 2:].contiguous().view(torch.int8).float()  # [6, 3, 32]
    blocks = w.view(6, 3, 32)
    assert torch.equal(d, (blocks.abs().amax(dim=2) / 127).half().float())
    assert torch.equal(qs, torch.round(blocks / torch.where(d == 0, 1.0, d)[..., None]).clamp(-127, 127))
    back = Q.dequantize(q)
    assert torch.equal(back, (d[..., None] * qs).view(6, 96))
    assert ((back - w).abs().view(6, 3, 32) <= d[..., None] * (0.5 + 1e-3)).all()
    assert torch.equal(back[2, 32:64], torch.zeros(32))


def test_shapes_a_format_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="a Q4_K row of 576 weights is not a whole number of 256-weight blocks"):
        Q.QuantWeight(torch.zeros(2, 576 // 256 * 144 + 72, dtype=torch.uint8), Q.FORMATS["Q4_K"], 576)
    with pytest.raises(ValueError, match="I8_ROW row of 40 weights"):
        Q.quantize_int8(torch.randn(3, 40))


def test_quant_linear_mixed_formats_and_bias():
    """A fused weight whose parts differ in format computes each part into its own columns."""
    (a, ra), (b, rb) = random_weight("Q4_K", 8, 256), random_weight("Q6_K", 4, 256, seed=2)
    bias = torch.randn(12)
    layer = Q.QuantLinear.stacked([a, b], bias)
    assert [p.fmt.name for p in layer.parts] == ["Q4_K", "Q6_K"]
    x = torch.randn(3, 256)
    out = layer(x)
    check_close(out - bias, x, np.concatenate([ra, rb]))
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    same = Q.QuantLinear.stacked([a, random_weight("Q4_K", 2, 256, seed=5)[0]])
    assert len(same.parts) == 1 and same.out_features == 10
