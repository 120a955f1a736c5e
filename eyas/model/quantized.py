"""Weights kept in compact block formats on the CPU, computed with eyas's own kernel.

A ``QuantWeight`` is an ``[N, K]`` matrix held as ``N`` rows of its format's bytes: the GGUF block
layouts for GGML types (the file's bytes, unchanged), ``BF16`` rows made at load time from float
weights, and ``I8_ROW``, per-output-channel int8 made at load time. ``QuantLinear`` and
``QuantEmbedding`` stand in for ``Linear`` and ``nn.Embedding``; activations stay float32 (a bfloat16
input is widened, the output rounded back).

The products run in ``eyas/kernels/quant_gemm.c``, built for the best instruction set the CPU has
(``eyas.kernels.cpu_isa``): every output is summed in one fixed order, so a row's result does not
depend on the batch, the thread count or the instruction set.

Matmul precision (``MATMUL_PRECISIONS``, an ordered ladder that starts from PyTorch's names for its float32
matmuls): ``"highest"`` multiplies the float32 activations by the weights' float32 values; ``"medium"`` rounds
both to bfloat16 and sums the products in float32 with AVX512-BF16 dot products (half the instructions), on
CPUs that have them; ``"low"`` quantizes the activations to int8 per block of 32 and multiplies them by the
weights' own block integers with integer dot products (``eyas/kernels/q8_gemm.c``: VNNI where the CPU has it),
as llama.cpp does, reading Q4_0, Q4_1 and Q8_0 interleaved 16 rows at a time (``QuantWeight.interleave``, in
place); F16 and BF16 weights, which hold no integers, stay on float32 products there. In every mode a row's
result does not depend on the batch or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

from eyas.model.host_memory import host_zeros


@dataclass(frozen=True)
class Format:
    name: str
    type_id: int  # GGML's type number; I8_ROW is eyas's own
    block_size: int  # weights per block
    block_bytes: int


FORMATS = {f.name: f for f in (
    Format("F16", 1, 1, 2), Format("BF16", 30, 1, 2),
    Format("Q4_0", 2, 32, 18), Format("Q4_1", 3, 32, 20), Format("Q8_0", 8, 32, 34),
    Format("Q4_K", 12, 256, 144), Format("Q5_K", 13, 256, 176), Format("Q6_K", 14, 256, 210),
    Format("I8_ROW", 1000, 1, 1),
    # the same blocks interleaved 16 rows at a time for matmul precision "low" (eyas/kernels/q8_interleaved.h)
    Format("Q4_0_R16", 2002, 32, 18), Format("Q4_1_R16", 2003, 32, 20), Format("Q8_0_R16", 2008, 32, 34),
)}
KERNEL_ALIGN = 32  # rows are decoded 32 weights at a time
MATMUL_PRECISIONS = {"highest": None, "medium": "bf16_products", "low": None}  # -> quant_gemm.c's variant
INTERLEAVED = {"Q4_0": "Q4_0_R16", "Q4_1": "Q4_1_R16", "Q8_0": "Q8_0_R16"}  # GGUF format -> its "low" layout
ROWS_OF = {v: k for k, v in INTERLEAVED.items()}  # interleaved layout -> the GGUF format of its rows
INTEGER_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "I8_ROW", *ROWS_OF})  # q8_gemm.c's


@dataclass
class QuantWeight:
    """An [N, K] weight: ``data`` [N, row_bytes] uint8 in ``fmt``; ``scale`` [N] float32 for I8_ROW."""

    data: torch.Tensor
    fmt: Format
    in_features: int
    scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.in_features % max(self.fmt.block_size, KERNEL_ALIGN) != 0:
            raise ValueError(f"quantization: a {self.fmt.name} row of {self.in_features} weights is not a whole "
                             f"number of {max(self.fmt.block_size, KERNEL_ALIGN)}-weight blocks")
        assert self.data.dtype == torch.uint8 and self.data.shape[1] == self.row_bytes, (self.data.shape, self.fmt)
        assert self.fmt.name not in ROWS_OF, "a weight is made in its GGUF row order; interleave() makes the other"

    @property
    def out_features(self) -> int:
        return self.data.shape[0]  # [N, row_bytes]

    @property
    def row_bytes(self) -> int:
        return self.in_features // self.fmt.block_size * self.fmt.block_bytes

    def interleave(self, on: bool) -> None:
        """Interleave the rows 16 at a time, in place, as matmul precision "low" reads Q4_0, Q4_1 and Q8_0 (``on``),
        or give them back their GGUF order; nothing for other formats. The bytes are only moved, so memory stays
        the same and the two layouts convert exactly. Every holder of this weight sees the new layout: a module
        that reads it (``QuantLinear.set_matmul_precision``, ``dequantize_rows``) reads ``fmt`` afterwards."""
        rows_fmt = ROWS_OF.get(self.fmt.name, self.fmt.name)
        if rows_fmt not in INTERLEAVED or (self.fmt.name in ROWS_OF) == on:
            return
        status = _layout()[0](self.data.data_ptr(), FORMATS[rows_fmt].type_id, self.out_features, self.in_features,
                              int(on))
        if status:
            raise MemoryError(f"quantization: no memory to interleave a {rows_fmt} weight")
        self.fmt = FORMATS[INTERLEAVED[rows_fmt] if on else rows_fmt]

    @staticmethod
    def cat(parts: list[QuantWeight], arena: Arena | None = None) -> QuantWeight:
        """Parts of one format stacked along the output rows (a fused q/k/v or gate/up weight), copied
        (into ``arena`` when given); parts in their GGUF row order."""
        assert len({(p.fmt, p.in_features) for p in parts}) == 1 and parts[0].fmt.name not in ROWS_OF
        scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts])
        rows = sum(p.out_features for p in parts)
        out = None if arena is None else arena.take(rows, parts[0].row_bytes)
        return QuantWeight(torch.cat([p.data for p in parts], out=out), parts[0].fmt, parts[0].in_features, scale)


class Arena:
    """One allocation that many weights are carved from: a single memory mapping, so the weights do
    not interleave with (and pin) the heap's freed blocks; the resident set stays their size. It is on huge
    pages where the OS gives them (``eyas.model.host_memory``)."""

    def __init__(self, nbytes: int):
        self.buffer = host_zeros((nbytes,), torch.uint8)
        self.used = 0

    def take(self, rows: int, row_bytes: int) -> torch.Tensor:
        """The next [rows, row_bytes] uint8 block."""
        start, self.used = self.used, self.used + rows * row_bytes
        assert self.used <= self.buffer.numel(), "arena too small"
        return self.buffer[start:self.used].view(rows, row_bytes)


def to_bf16(weight: torch.Tensor, arena: Arena | None = None) -> QuantWeight:
    """The [N, K] weight rounded to bfloat16 (round to nearest even), held as BF16 rows (in ``arena`` when given)."""
    rows, k = weight.shape
    data = torch.empty(rows, 2 * k, dtype=torch.uint8) if arena is None else arena.take(rows, 2 * k)
    data.view(torch.bfloat16).copy_(weight.detach())
    return QuantWeight(data, FORMATS["BF16"], k)


def quantize_int8(weight: torch.Tensor, arena: Arena | None = None) -> QuantWeight:
    """Per-output-channel symmetric int8: scale = max|w| / 127 per row, q = round(w / scale) (in ``arena`` when
    given)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / torch.where(scale == 0, 1.0, scale)[:, None]).clamp_(-127, 127).to(torch.int8)
    data = q.view(torch.uint8).contiguous() if arena is None else arena.take(*q.shape).copy_(q.view(torch.uint8))
    return QuantWeight(data, FORMATS["I8_ROW"], w.shape[1], scale.contiguous())


def quantize_q8_0(weight: torch.Tensor, arena: Arena | None = None) -> QuantWeight:
    """GGUF Q8_0 rows of the [N, K] weight (K a multiple of 32): per block of 32, the float16 scale
    d = max|w| / 127 and q = round(w / d) with that rounded d (so d * q is as close to w as the stored d allows),
    in ``arena`` when given. Finer than ``quantize_int8``'s one scale a row, and at matmul precision "low" its
    rows interleave for the VNNI products (``QuantWeight.interleave``)."""
    fmt, w = FORMATS["Q8_0"], weight.detach().float()
    n, k = w.shape
    nb = k // fmt.block_size
    blocks = w.view(n, nb, fmt.block_size)
    d = (blocks.abs().amax(dim=2) / 127).to(torch.float16)  # [N, nb]
    q = torch.round(blocks / torch.where(d == 0, 1.0, d.float())[..., None]).clamp_(-127, 127).to(torch.int8)
    data = torch.empty(n, nb * fmt.block_bytes, dtype=torch.uint8) if arena is None else arena.take(n, nb * fmt.block_bytes)
    records = data.view(n, nb, fmt.block_bytes)  # each block: d (2 bytes), then its quants
    records[:, :, :2] = d.view(torch.uint8).view(n, nb, 2)
    records[:, :, 2:] = q.view(torch.uint8)
    return QuantWeight(data, fmt, k)


@functools.cache
def _kernel(isa: str, variant: str | None = None) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    from eyas import kernels

    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    gemm = kernels.entry("quant_gemm", ptr, i64, ptr, i32, ptr, ptr, i64, i64, i64, i64, i32, isa=isa, variant=variant)
    rows = kernels.entry("quant_gemm", ptr, i32, ptr, ptr, i64, i64, ptr, i32, function="quant_rows", isa=isa,
                         variant=variant)
    return None if gemm is None else (gemm, rows)


@functools.cache
def q8_kernel(isa: str, variant: str | None = None, split: bool = False) -> ctypes._CFuncPtr | None:
    """q8_gemm.c's product (matmul precision "low") built for ``isa`` (and a ``vnni*`` variant), or None; ``split``:
    each row of activations as two int8 rows (``QuantLinear.set_matmul_precision``)."""
    from eyas import kernels

    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return kernels.entry("q8_gemm", ptr, i64, ptr, i32, ptr, ptr, i64, i64, i64, i64, i32,
                         function="q8_gemm_split" if split else None, isa=isa, variant=variant)


@functools.cache
def _layout() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """q8_gemm.c's (eyas_q8_interleave, eyas_q8_interleaved_rows), of the build "low" runs."""
    from eyas import kernels

    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    where = dict(isa=kernels.cpu_isa(), variant=kernels.dot_variant("q8_gemm"))
    interleave = kernels.entry("q8_gemm", ptr, i32, i64, i64, i32, function="q8_interleave", **where)
    rows = kernels.entry("q8_gemm", ptr, i32, i64, i64, ptr, i64, ptr, function="q8_interleaved_rows", **where)
    assert interleave is not None and rows is not None, "q8_gemm.c did not build"
    return interleave, rows


def _find(precision: str, split: bool = False):
    """The kernel's (gemm, rows) entries at this matmul precision, or None where they do not run here; "low"'s
    gemm is q8_gemm.c's (``split``: its product on activations split in two int8 rows), for the formats of
    ``INTEGER_FORMATS``."""
    from eyas.kernels import cpu_isa, dot_variant, variant_supported

    variant = MATMUL_PRECISIONS[precision]
    if variant is not None and not variant_supported(variant):
        return None
    found = _kernel(cpu_isa(), variant)
    if precision != "low" or found is None:
        return found
    q8 = q8_kernel(cpu_isa(), dot_variant("q8_gemm"), split)
    return None if q8 is None else (q8, found[1])


def tiled_rows(isa: str, variant: str | None) -> int:
    """The rows of x from which that build of q8_gemm.c multiplies interleaved weights on AMX tiles; 0 if never
    (no AMX build, or the OS refuses the tile state)."""
    from eyas import kernels

    fn = kernels.entry("q8_gemm", function="q8_tiled_rows", isa=isa, variant=variant)
    return 0 if fn is None else fn()


def dot_products() -> str:
    """How q8_gemm.c's build for this CPU computes its integer dot products, in words (for logs and reports)."""
    from eyas.kernels import cpu_isa, dot_variant

    variant = dot_variant("q8_gemm")
    words = {"amx": "AVX512-VNNI vpdpbusd", "vnni512": "AVX512-VNNI vpdpbusd", "vnni256": "AVX-VNNI vpdpbusd"}.get(
        variant, {"avx512": "AVX2 vpmaddubsw", "avx2": "AVX2 vpmaddubsw"}.get(cpu_isa(), "portable C"))
    rows = tiled_rows(cpu_isa(), variant) if variant == "amx" else 0
    return words + (f", AMX tdpbssd from {rows} rows" if rows else "")


def kernel_available(precision: str = "highest") -> bool:
    """Whether the quantized kernel builds here (a C compiler is needed) at this matmul precision (``"medium"``:
    only on a CPU with AVX512-BF16, and without ``EYAS_CPU_ISA`` forcing a lesser instruction set)."""
    return _find(precision) is not None


def _entries(precision: str = "highest", split: bool = False):
    found = _find(precision, split)
    if found is None:
        raise RuntimeError(f"quantization: eyas's quantized CPU kernel at matmul precision {precision!r} could not be "
                           "built here (no C compiler, or no AVX512-BF16 for 'medium'); load the model with "
                           "quantization=None or matmul_precision='highest'")
    return found


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequantize_rows(weight: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``rows`` [R] (int64) of the weight -> [R, K]."""
    rows = rows.to(torch.int64).contiguous()
    ids = rows.tolist()  # checked as host ints: a decode step's one row, where two reductions cost 10 us
    if ids and not 0 <= min(ids) <= max(ids) < weight.out_features:
        raise IndexError(f"row index out of range [0, {weight.out_features})")
    out = torch.empty(rows.numel(), weight.in_features, dtype=torch.float32)
    data, fmt = weight.data, weight.fmt
    if fmt.name in ROWS_OF:  # interleaved: the rows' GGUF bytes first
        fmt = FORMATS[ROWS_OF[fmt.name]]
        data = torch.empty(rows.numel(), weight.row_bytes, dtype=torch.uint8)
        assert _layout()[1](weight.data.data_ptr(), fmt.type_id, weight.out_features, weight.in_features,
                            rows.data_ptr(), rows.numel(), data.data_ptr()) == 0
        rows = torch.arange(rows.numel())
    _, gather = _entries()
    status = gather(data.data_ptr(), fmt.type_id, _ptr(weight.scale), rows.data_ptr(), rows.numel(),
                    weight.in_features, out.data_ptr(), torch.get_num_threads())
    assert status == 0
    return out


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The whole weight in float32, [N, K]."""
    return dequantize_rows(weight, torch.arange(weight.out_features))


PRECISION_CHANGES = 0  # calls of QuantLinear.set_matmul_precision so far, in this process

class QuantLinear(nn.Module):
    """``Linear`` over one or more ``QuantWeight`` parts stacked along the output (a fused q/k/v whose
    parts differ in format takes one kernel call per part, into its columns of the output)."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.set_matmul_precision("highest")

    @classmethod
    def stacked(cls, parts: list[QuantWeight], bias: torch.Tensor | None = None,
                arena: Arena | None = None) -> QuantLinear:
        """Runs of parts in one format are copied into one weight each (one kernel call per run), into
        ``arena`` when given; nothing refers to the parts' storage (e.g. a file mapping) afterwards."""
        runs: list[list[QuantWeight]] = []
        for part in parts:
            if runs and runs[-1][0].fmt == part.fmt:
                runs[-1].append(part)
            else:
                runs.append([part])
        return cls([QuantWeight.cat(run, arena) for run in runs], bias)

    def set_matmul_precision(self, precision: str, split: bool = False) -> None:
        """Multiply at this precision (a key of ``MATMUL_PRECISIONS``) from now on. ``split`` (at "low" only): each
        block of activations goes in as two int8 blocks, its quantization and what that leaves, so the activations
        are exact to about 2^-16 of a block's max instead of 2^-8, for twice one row's integer work (the attention's
        q/k/v, whose roundings the softmax exponentiates: ``eyas.model.loader.set_matmul_precision``).

        The kernel call of each part is resolved here once: a decode step makes over a hundred of them. Public
        for eyas.model.fused_decoder, which makes the same calls from C: (entry point, weight address, type id,
        row-scale address or None, first output column, output rows) per part."""
        global PRECISION_CHANGES
        PRECISION_CHANGES += 1  # plans made from ``calls`` (eyas.model.fused_decoder) are stale now
        if split and precision != "low":
            raise ValueError(f"QuantLinear: split activations are a mode of matmul precision 'low', not {precision!r}")
        gemm = _entries(precision, split)[0]
        float_gemm = _entries()[0] if precision == "low" else gemm  # F16 / BF16: no integers to multiply
        self.calls, column = [], 0
        for p in self.parts:
            assert p.data.is_contiguous()
            p.interleave(precision == "low")
            fn = gemm if p.fmt.name in INTEGER_FORMATS else float_gemm
            self.calls.append((fn, p.data.data_ptr(), p.fmt.type_id, _ptr(p.scale), column, p.out_features))
            column += p.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        x2 = x if plain else x.reshape(-1, x.shape[-1]).float().contiguous()  # [M, K]
        rows, k = x2.shape
        if k != self.in_features:
            raise ValueError(f"QuantLinear: input has {k} features, expected {self.in_features}")
        out = torch.empty(rows, self.out_features, dtype=torch.float32)  # [M, N]
        x_ptr, out_ptr, threads = x2.data_ptr(), out.data_ptr(), torch.get_num_threads()
        for gemm, w_ptr, type_id, scale_ptr, column, n in self.calls:
            if gemm(x_ptr, k, w_ptr, type_id, scale_ptr, out_ptr + 4 * column, self.out_features, rows, n, k, threads):
                raise RuntimeError(f"quant_gemm failed on {self.extra_repr()}")
        if self.bias is not None:
            out += self.bias
        return out if plain else out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        formats = "+".join(p.fmt.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` whose table is a ``QuantWeight``; rows are dequantized as they are looked up."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = dequantize_rows(self.weight_q, ids.reshape(-1))
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight_q.fmt.name}"
