"""A Llama model's decoder layers and final norm in one C call (``eyas/kernels/decoder_layers.c``) on the CPU,
which also copies out the aux hidden states a hidden-state drafter reads (the streams entering chosen layers).

A batch-1 decode step of the default model makes about 30 Python-level module calls per layer (norms,
products, rotary, attention, SiLU gate, residual adds), 0.9 ms of a 9 ms step on 2 threads. The C
loop calls the same compiled kernels, in the same order, on the same buffers, so its result equals
the modules' bit for bit (``tests/test_fused_decoder.py``); only the Python between them goes.

It applies where every step of a layer has a native kernel: weights as ``QuantLinear`` (GGUF, int8
or bf16 rows) without biases, no QK norm, float32 activations and KV cache on the CPU, the ``cpu``
attention backend, and nothing recorded for autograd. Everywhere else the modules run.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from eyas.kernels.token_ops import token_ops
from eyas.model.attention.cpu import CpuBackend, CpuMetadata
from eyas.model.attention.cpu import load_kernel as attention_kernel
from eyas.model.forward_context import get_forward_context
from eyas.model.layers import RMSNorm
from eyas.model.quantized import QuantLinear

_PARTS_MAX, _PART_WORDS = 3, 5  # as decoder_layers.c's PARTS_MAX, PART_WORDS
_LAYER_WORDS = 4 + 4 * _PARTS_MAX * _PART_WORDS


class _Model(ctypes.Structure):  # decoder_layers.c's model_t
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("rms_norm", ctypes.c_void_p), ("rotary", ctypes.c_void_p),
                ("silu_mul", ctypes.c_void_p), ("attention", ctypes.c_void_p)]


@functools.cache
def _kernel():
    from eyas import kernels

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    run = kernels.entry("decoder_layers", ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64,
                        ctypes.c_int, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int)
    if run is None:
        return None
    work = kernels.load("decoder_layers").eyas_decoder_work_floats
    work.restype, work.argtypes = i64, [ptr, i64]
    return run, work


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _linear_words(linear) -> list[int] | None:
    """A product's PARTS_MAX slots of (entry point, weight, type, row scale, output rows), or None when the
    C loop cannot run it."""
    if not isinstance(linear, QuantLinear) or linear.bias is not None or len(linear.parts) > _PARTS_MAX:
        return None
    words = []
    for (gemm, w_ptr, type_id, scale_ptr, _, n) in linear.calls:
        words += [_address(gemm), w_ptr, type_id, scale_ptr or 0, n]
    return words + [0] * (_PARTS_MAX * _PART_WORDS - len(words))


class FusedDecoder:
    """The plan of a model's decoder layers for the C loop, bound to their KV caches."""

    def __init__(self, model_struct: _Model, plan: torch.Tensor, norm: RMSNorm, group: int, modules: list):
        self.model_struct = model_struct
        self.plan = plan  # [num_layers, LAYER_WORDS] int64
        self.norm = norm  # the final norm
        self.group = group  # the layers' KV-cache group (whose attention metadata they read)
        self._modules = modules  # the layers whose weights and caches the plan points into, kept alive with it
        # the C loop's scratch, kept between calls at the most any call needed: a new one each call cost a prefill
        # its pages anew (66 MB at 2,048 tokens of the default model, written once a call; a step was four calls
        # when the runs were cut at EAGLE-3's aux layers)
        self._work = torch.empty(0, dtype=torch.float32)

    @classmethod
    def build(cls, layers, norm) -> FusedDecoder | None:
        """The plan for ``layers`` (a model's plain Llama ``DecoderLayer`` list, as the caller checks) and the final
        ``norm``, or None when one of them is not made of parts the C loop runs (see the module docstring) or a
        kernel cannot be built."""
        if _kernel() is None or token_ops() is None or attention_kernel() is None:
            return None
        first = layers[0]
        attn0 = first.self_attn
        eps = first.input_layernorm.eps
        if type(norm) is not RMSNorm or norm.eps != eps or norm.weight.dtype != torch.float32:
            return None
        rows = []
        for layer in layers:
            attn = layer.self_attn
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            cache = attn.kv_cache
            if (attn.q_norm is not None
                    or any(type(n) is not RMSNorm or n.eps != eps or n.weight.dtype != torch.float32 for n in norms)
                    or cache is None or cache.dtype != torch.float32 or not cache.is_cpu or not cache.is_contiguous()
                    or attn.kv_cache_group != attn0.kv_cache_group or attn.sliding_window is not None):
                return None
            linears = [_linear_words(m) for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                                                   layer.mlp.down_proj)]
            if any(words is None for words in linears):
                return None
            rows.append([norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), cache.data_ptr(), cache.shape[1],
                         *(w for words in linears for w in words)])
        ops = token_ops()
        struct = _Model(first.input_layernorm.weight.shape[0], attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                        first.mlp.down_proj.in_features, eps, attn0.head_dim ** -0.5, _address(ops.rms_norm),
                        _address(ops.rotary), _address(ops.silu_mul), _address(attention_kernel()))
        plan = torch.tensor(rows, dtype=torch.int64)
        assert plan.shape[1] == _LAYER_WORDS
        return cls(struct, plan, norm, attn0.kv_cache_group, list(layers))

    def metadata(self, h: torch.Tensor) -> CpuMetadata | None:
        """This forward's attention metadata if the C loop can run it on ``h``, else None."""
        if not (h.dtype is torch.float32 and h.is_cpu and h.dim() == 2) or torch.is_grad_enabled():
            return None
        ctx = get_forward_context()
        if not isinstance(ctx.backend, CpuBackend):
            return None
        meta = ctx.attn_metadata.get(self.group)
        return meta if isinstance(meta, CpuMetadata) else None

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stop: int, aux_at: tuple[int, ...],
            meta: CpuMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [0, stop) on h [T, hidden] (worked on in place), then the final norm -> (normed [T, hidden], aux
        [T, len(aux_at), hidden] or None: the stream entering layer aux_at[j] in slot j); cos, sin [T, 1,
        head_dim / 2] (contiguous)."""
        run, work_floats = _kernel()
        model = ctypes.byref(self.model_struct)
        h = h.contiguous()
        tokens, width = h.shape
        need = work_floats(model, tokens)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        normed = torch.empty_like(h)
        aux = torch.empty(tokens, len(aux_at), width) if aux_at else None
        at = (ctypes.c_int64 * len(aux_at))(*aux_at)
        status = run(model, self.plan.data_ptr(), stop, h.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(),
                     *meta.kernel_args, meta.zero_fill, at, len(aux_at), None if aux is None else aux.data_ptr(),
                     self.norm.weight.data_ptr(), normed.data_ptr(), self._work.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise MemoryError("paged attention kernel: out of memory for its work buffers")
        if status != 0:
            raise RuntimeError("decoder_layers: a quantized product failed")
        return normed, aux
