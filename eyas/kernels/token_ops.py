"""The C entry points of ``token_ops.c`` (norms, rotary, SiLU, and the sampler's reductions over vocabulary rows),
typed, and when an op may take them."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from eyas import kernels


class TokenOps(NamedTuple):
    rms_norm: ctypes._CFuncPtr
    rotary: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    argmax: ctypes._CFuncPtr
    gumbel_argmax: ctypes._CFuncPtr
    top_values: ctypes._CFuncPtr
    log_normaliser: ctypes._CFuncPtr
    log_softmax_above: ctypes._CFuncPtr
    nucleus: ctypes._CFuncPtr


@functools.cache
def token_ops() -> TokenOps | None:
    """The C entry points of ``eyas/kernels/token_ops.c``, or None where it cannot be built."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    norm = kernels.entry("token_ops", ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, function="rms_norm")
    if norm is None:
        return None
    return TokenOps(norm, kernels.entry("token_ops", ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32, function="rotary"),
                     kernels.entry("token_ops", ptr, ptr, i64, i64, i32, function="silu_mul"),
                     kernels.entry("token_ops", ptr, ptr, i64, i64, i32, function="argmax"),
                     kernels.entry("token_ops", ptr, ptr, ptr, ptr, ptr, i64, i64, i32, function="gumbel_argmax"),
                     kernels.entry("token_ops", ptr, ptr, i64, i64, i64, i32, function="top_values"),
                     kernels.entry("token_ops", ptr, ptr, ptr, i64, i64, i32, function="log_normaliser"),
                     kernels.entry("token_ops", ptr, ptr, i64, i64, i32, function="log_softmax_above"),
                     kernels.entry("token_ops", ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, function="nucleus"))


def native(x: torch.Tensor, param: torch.Tensor | None = None) -> bool:
    """Whether an op on activation ``x`` (with float32 ``param``: a norm weight, a cos table) takes
    ``token_ops.c``: float32 on the CPU, nothing recorded for autograd, and the kernel builds."""
    if not (x.dtype is torch.float32 and x.is_cpu and (param is None or param.dtype is torch.float32)):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (param is not None and param.requires_grad)):
        return False
    return token_ops() is not None
