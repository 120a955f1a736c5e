"""What the benchmark scripts share (imported as a sibling module): argument types, the weight modes they name,
and the CPU line each prints (the CPU differs between machines; a figure means little without the flags it ran
with)."""

from __future__ import annotations

import argparse

from eyas.kernels import cpu_flags, cpu_isa

SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
               "amx_bf16", "amx_int8")


def weight_mode(spec: str) -> dict:
    """``LLM`` keyword arguments of a weight mode as the scripts' ``--modes`` name it: a quantization (``none`` = the
    engine dtype), then ``@highest``, ``@medium`` or ``@low`` for the products' matmul precision (without it, the engine's
    default, "auto"). ``"gguf@highest"`` -> quantization "gguf", float32 products; ``"int8"`` -> quantization
    "int8", matmul precision "auto"."""
    quantization, _, precision = spec.partition("@")
    return {"quantization": None if quantization == "none" else quantization, "matmul_precision": precision or "auto"}


def batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; every size >= 1, at least one."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least one size, all >= 1")
    return sizes


def cpu_line() -> str:
    """``CPU: <the flags of SHOWN_FLAGS this CPU has>; eyas kernels built for: <isa>``."""
    flags = cpu_flags()
    return f"CPU: {' '.join(f for f in SHOWN_FLAGS if f in flags)}; eyas kernels built for: {cpu_isa()}"
