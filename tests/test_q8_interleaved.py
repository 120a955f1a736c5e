"""Q4_0, Q4_1 and Q8_0 interleaved 16 rows at a time for matmul precision "low" (``eyas/kernels/q8_interleaved.h``):
the layout against one written here from its definition, undone exactly in place, and products that equal the
products on the GGUF rows bit for bit, in every instruction-set build this CPU runs, at 1..24 rows of x, for row
counts that leave a partial group of 16 and widths that leave a partial group of 8 blocks; on AMX, the tiled
products (16 rows of x and more) equal vpdpbusd's bit for bit."""

import numpy as np
import pytest
import torch
from test_q8_kernels import _builds, _run, weight_of

from eyas import kernels
from eyas.model import quantized as Q

pytestmark = pytest.mark.skipif(not Q.kernel_available("low"), reason="no C compiler: the q8 kernel cannot be built")

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
# (N, K): whole groups; a last group of 5 rows; fewer rows than a group; one block; 9 and 18 blocks (lanes 0 and
# 0-1 hold one block more than the others); 48 blocks (the MLP's down projection)
SHAPES = [(32, 256), (37, 576), (5, 288), (21, 32), (16, 1536)]


def reference_layout(data: np.ndarray, fmt: str) -> np.ndarray:
    """The interleaved bytes of ``data`` [N, row bytes], from the layout's definition: per group of 16 rows (the
    last one R rows), per block in lane order (b mod 8, then b), the R rows' float16 d, then their m (Q4_1), then
    quant chunk c of each row, 4 bytes, chunk by chunk."""
    block = Q.FORMATS[fmt].block_bytes
    halves = 2 if fmt == "Q4_1" else 1
    n, row_bytes = data.shape
    nsub = row_bytes // block
    blocks = data.reshape(n, nsub, block)
    out = []
    for g in range(0, n, 16):
        rows = blocks[g:g + 16]  # [R, nsub, block]
        for b in sorted(range(nsub), key=lambda b: (b % 8, b)):
            blk = rows[:, b]  # [R, block]
            out += [blk[:, 2 * h:2 * h + 2].reshape(-1) for h in range(halves)]
            quants = blk[:, 2 * halves:].reshape(len(rows), -1, 4)  # [R, C, 4]
            out.append(quants.transpose(1, 0, 2).reshape(-1))  # [C, R, 4]
    return np.concatenate(out).reshape(n, row_bytes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layout_is_the_definition_and_is_undone_in_place(fmt):
    for n, k in SHAPES:
        weight, _ = weight_of(fmt, n, k, seed=n)
        gguf = weight.data.clone()
        address = weight.data.data_ptr()
        weight.interleave(True)
        assert weight.fmt.name == f"{fmt}_R16" and weight.data.data_ptr() == address  # same bytes, same place
        assert np.array_equal(weight.data.numpy(), reference_layout(gguf.numpy(), fmt)), (n, k)
        weight.interleave(True)  # already interleaved: nothing moves
        assert np.array_equal(weight.data.numpy(), reference_layout(gguf.numpy(), fmt))
        weight.interleave(False)
        assert weight.fmt.name == fmt and torch.equal(weight.data, gguf)


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaved_products_equal_the_row_products_bit_for_bit(fmt):
    """The same kernel build on the GGUF rows (q8_gemm.c's tile loop) and on the interleaved rows (a vpdpbusd lane
    an output row, 8 lane accumulators a register): the same float sums in the same order, so equal bits."""
    builds = _builds()
    x = torch.randn(24, 1536, generator=torch.Generator().manual_seed(7)) * 2
    x[3, :32] = 0  # an all-zero block of activations
    for n, k in SHAPES:
        rows, _ = weight_of(fmt, n, k, seed=n)
        interleaved, _ = weight_of(fmt, n, k, seed=n)
        interleaved.interleave(True)
        for build in builds:
            kernel = Q.q8_kernel(*build)
            for m in (*range(1, 10), 16, 17, 24):
                xm = x[:m, :k].contiguous()
                assert torch.equal(_run(kernel, xm, interleaved), _run(kernel, xm, rows)), (build, n, k, m)
            split = Q.q8_kernel(*build, True)  # two rows of x each: 2 .. 48 rows
            for m in (1, 4, 8, 9, 24):
                xm = x[:m, :k].contiguous()
                assert torch.equal(_run(split, xm, interleaved), _run(split, xm, rows)), (build, n, k, m)


@pytest.mark.parametrize("split", [False, True], ids=["int8", "split"])
def test_rows_past_a_panel_equal_the_rows_alone(split):
    """Past 256 rows of x (a panel: the rows one sweep over the groups takes) each row still equals its product
    alone, on 1 and 2 threads, with a last group of 5 rows (widened once, used by every panel)."""
    weight, _ = weight_of("Q4_1", 37, 576, seed=4)
    linear = Q.QuantLinear([weight])
    linear.set_matmul_precision("low", split=split)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(12))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = linear(x)
        torch.set_num_threads(1)
        one = linear(x)
        assert torch.equal(one, two)
        for i in (0, 127, 128, 255, 256, 299):
            assert torch.equal(linear(x[i:i + 1].contiguous()), one[i:i + 1]), i
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.variant_supported("amx"), reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_tiles_give_the_bits_of_vpdpbusd(fmt):
    """From 16 rows of x the AMX build takes the block integers from tdpbssd (16 rows of x a tile, in panels of
    256 rows) and adds the same float terms in the same order: equal bits to the vpdpbusd build, just below the
    threshold, at it, with a partial last tile of rows (17, 31, 69, 200), across a second panel (300), for
    partial groups of 16 outputs and partial lanes (the SHAPES)."""
    rows = Q.tiled_rows("avx512", "amx")
    if rows == 0:
        pytest.skip("the OS refuses the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    assert rows == 16
    amx, vnni = Q.q8_kernel("avx512", "amx"), Q.q8_kernel("avx512", "vnni512")
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(11)) * 2
    x[3, :32] = 0  # an all-zero block of activations
    x[270, 64:96] *= 1000  # a coarse block in the second panel
    for n, k in SHAPES:
        weight, _ = weight_of(fmt, n, k, seed=n)
        weight.interleave(True)
        for m in (rows - 1, rows, 17, 31, 32, 69, 200, 300):
            xm = x[:m, :k].contiguous()
            assert torch.equal(_run(amx, xm, weight), _run(vnni, xm, weight)), (n, k, m)
        for m in (7, 8, 9, 150):  # split: 2m rows of x
            xm = x[:m, :k].contiguous()
            assert torch.equal(_run(Q.q8_kernel("avx512", "amx", True), xm, weight),
                               _run(Q.q8_kernel("avx512", "vnni512", True), xm, weight)), (n, k, m)


def test_the_tied_embedding_reads_the_interleaved_head_and_highest_gets_the_rows_back():
    """A tied embedding shares its weight with the head: once "low" interleaves the head, lookups still give the
    GGUF rows' values; setting the head back to "highest" restores the bytes and its float products."""
    weight, w = weight_of("Q8_0", 40, 576)
    gguf = weight.data.clone()
    embedding, head = Q.QuantEmbedding(weight), Q.QuantLinear([weight])
    x = torch.randn(3, 576)
    highest = head(x)
    head.set_matmul_precision("low")
    assert weight.fmt.name == "Q8_0_R16"
    ids = torch.tensor([[0, 17, 39], [16, 15, 32]])
    assert torch.equal(embedding(ids), torch.from_numpy(w[ids.numpy()]))
    head.set_matmul_precision("highest")
    assert weight.fmt.name == "Q8_0" and torch.equal(weight.data, gguf) and torch.equal(head(x), highest)


def test_a_weight_is_made_in_row_order():
    weight, _ = weight_of("Q4_1", 16, 64)
    weight.interleave(True)
    with pytest.raises(AssertionError, match="GGUF row order"):
        Q.QuantWeight(weight.data[:8], weight.fmt, 64)
