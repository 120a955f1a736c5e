"""Building blocks shared by the model classes: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import ctypes
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas.kernels.token_ops import native, token_ops


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU products take the fastest of three paths for their row count and dtype.

    * float32, 1..24 rows: eyas's own kernel (``eyas/kernels/small_gemm.c``), which reads the weight
      in place, once, with the next weight tile prefetched while the current one is multiplied.
      Over all of SmolLM2-135M's weights on the project's 2-core AVX2 CPU (oneDNN packed -> this
      kernel): 1 thread, 1 row 72 -> 55 ms, 9 rows 122 -> 74 ms, 24 rows 158 -> 146 ms; 2 threads,
      1 row 43 -> 31 ms, 9 rows 60 -> 40 ms, 24 rows 93 -> 78 ms (at 32 rows oneDNN is level or
      ahead). Each output is summed by one thread in a fixed order, so a row's result does not
      depend on the thread count or on the other rows (batch invariance).
    * float32, 25..256 rows: oneDNN's pre-packed (blocked) weight layout beats the BLAS call of
      ``F.linear`` wherever the weight dominates (2 threads: 33 rows 129 -> 85 ms, 128 rows 338 ->
      288 ms; at 512 rows the two are level).
    * bfloat16 / float16 weights on a CPU without native support for them (no AVX512-BF16 / AMX;
      the project's CPU): PyTorch's GEMV reads half the bytes of float32 and wins at one row (15
      ms), but products of more rows are emulated at about one GEMV per row (5 rows 69 ms, 64 rows
      864 ms). Products of 2 or more rows take the packed float32 copy instead (5 rows 35 ms, 64
      rows 156 ms): inputs are widened exactly, products summed in float32 and rounded back, the
      arithmetic of a native half-precision GEMM with float32 accumulation. The copy costs twice
      the half-precision weight's memory.

    The packed copy is made on first use and remade whenever the weight is replaced or changed in
    place (its storage or version counter moves; a weight created under ``inference_mode`` has no
    version counter, so only its replacement is seen). Neither native path is used where autograd
    records; where no C compiler exists, float32 products of 1..24 rows take the packed path.
    """

    SMALL_MAX_ROWS = 24  # float32 inputs up to this many rows take eyas's kernel
    PACKED_MAX_ROWS = 256  # float32 inputs; emulated half-precision inputs take the packed copy at any count

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None  # ((data_ptr, version), packed weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_small(x):
            return _small_gemm(x, self.weight, self.bias)
        if self._takes_packed(x):
            bias = None if self.bias is None else self.bias.float()
            out = torch.ops.mkldnn._linear_pointwise(x.float(), self._packed_weight(), bias, "none", [], "")
            return out.to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def _takes_small(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dim() == 2 and x.dtype == self.weight.dtype == torch.float32
                and 0 < x.shape[0] <= self.SMALL_MAX_ROWS and not self._records(x) and _small_gemm_kernel() is not None)

    def _records(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)

    def _takes_packed(self, x: torch.Tensor) -> bool:
        if not (_MKLDNN and x.device.type == "cpu" and x.dim() == 2 and x.dtype == self.weight.dtype):
            return False
        if self._records(x):
            return False
        rows = x.shape[0]
        if x.dtype == torch.float32:
            return 0 < rows <= self.PACKED_MAX_ROWS
        return x.dtype in _EMULATED_HALF and rows >= 2

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)  # inference tensors keep no version
        if self._packed is None or self._packed[0] != key:
            self._packed = key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), 16)
        return self._packed[1]


_MKLDNN = torch.backends.mkldnn.is_available()


@functools.cache
def _small_gemm_kernel():
    """The C entry point of ``eyas/kernels/small_gemm.c``, or None where it cannot be built."""
    from eyas import kernels

    return kernels.entry("small_gemm", *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 3, ctypes.c_int)


def _small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N], float32, through the C kernel."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _small_gemm_kernel()(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1],
                         torch.get_num_threads())
    return out if bias is None else out.add_(bias)


def _emulated_half() -> frozenset[torch.dtype]:
    """Half-precision dtypes this CPU has no native matmul for (PyTorch then emulates them)."""
    if not _MKLDNN:
        return frozenset()
    supported_here = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                      torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    return frozenset(dtype for dtype, supported in supported_here.items() if not supported)


_EMULATED_HALF = _emulated_half()


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; float32 CPU inputs take one call of ``token_ops.c`` (PyTorch's
    op order, its sum of squares added up in another order: within a few units in the last place)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not native(x, weight):
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        x = x.contiguous()  # [..., size]
        out = torch.empty_like(x)
        size = x.shape[-1]
        token_ops().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, self.eps,
                              torch.get_num_threads())
        return out


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2n] (gate, then up) -> silu(gate) * up [..., n]. Float32 CPU inputs take one call of
    ``token_ops.c`` (within a few units in the last place of PyTorch's ops: its exp differs)."""
    if not native(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    *lead, width = gate_up.shape
    out = torch.empty(*lead, width // 2, dtype=torch.float32)
    token_ops().silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // width, width // 2,
                          torch.get_num_threads())
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, smooth in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF ``rotate_half`` layout) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # made on the host even inside a meta-device context (a module built there, then filled): meta tensors'
        # arithmetic imports torch._dynamo, about a second of start-up
        host = torch.device("cpu")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=host) / head_dim)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling: type '{kind}' is not supported (supported: default, llama3)")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=host), inv_freq)
        # [max_positions, 1, head_dim/2]: a lookup is then the table's shape already (a batch-1 step's ops count)
        self.register_buffer("cos", freqs.cos().float()[:, None], persistent=False)
        self.register_buffer("sin", freqs.sin().float()[:, None], persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: ``[num_tokens, 1, head_dim/2]``, computed once per forward."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] rotated by position (first half pairs with second half), into a new
    contiguous tensor; cos, sin: [num_tokens, 1, head_dim/2]. Float32 CPU inputs take one call of
    ``token_ops.c`` (the same bits), which reads x in place when each token's heads lie back to back (the
    q/k view of a fused q/k/v product)."""
    if not native(x, cos):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(num_tokens, heads, head_dim, dtype=torch.float32)
    token_ops().rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), num_tokens, heads,
                        head_dim, torch.get_num_threads())
    return out
