"""AMX tiles against vpdpbusd for matmul precision "low": q8_gemm.c's "amx" build (tdpbssd from 16 rows of x)
against its "vnni512" build (vpdpbusd only), in one process on one thread, on the default model.

- Products: every integer product of the model's "low" forward (the interleaved Q4_1 layers and the Q8_0 head;
  q/k/v, which the engine calls with each row split in two, here as plain int8 rows), called directly on random
  activations at each ``--rows``; the builds and row counts interleaved for ``--rounds`` rounds, the fastest pass
  of each by the thread's CPU time. The two builds' outputs are checked equal bit for bit first.
- Prefill: one engine per build (``num_threads=1``, no prefix cache), the same ``--prompts`` held-out chat
  prompts with ``max_tokens=1``: prompt tokens per CPU second, the fastest of ``--rounds``.

    python benchmarks/bench_tiles.py [--rows 1,16,64,256] [--prompts 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from bench_common import batch_sizes, cpu_line

from eyas import LLM, SamplingParams, kernels
from eyas.data.prompts import HELD_OUT_START, chat_prompts
from eyas.model import quantized as Q

BUILDS = ("vnni512", "amx")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=batch_sizes, default=[1, 16, 64, 256])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


@contextlib.contextmanager
def q8_build(variant: str):
    """Engines made inside take q8_gemm.c's ``variant`` build (the engine takes the first one that runs)."""
    chosen = kernels.dot_variant
    kernels.dot_variant = lambda name: variant if name == "q8_gemm" else chosen(name)
    try:
        yield
    finally:
        kernels.dot_variant = chosen


def integer_calls(model) -> list[tuple]:
    """(entry args but the kernel) of every integer product of ``model`` at "low": (weight, type, scale, column,
    rows, in features, out features)."""
    return [(w, t, s, col, n, m.in_features, m.out_features) for m in model.modules() if isinstance(m, Q.QuantLinear)
            for (_, w, t, s, col, n) in m.calls if t >= 2000]  # R16 formats: the interleaved rows


def products(fn, calls: list[tuple], xs: dict, outs: dict) -> float:
    """Thread CPU seconds of one pass of ``calls`` through kernel ``fn``."""
    start = time.thread_time()
    for w, t, s, col, n, k, nout in calls:
        x, out = xs[k], outs[nout]
        assert fn(x.data_ptr(), k, w, t, s, out.data_ptr() + 4 * col, nout, x.shape[0], n, k, 1) == 0
    return time.thread_time() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    if not kernels.variant_supported("amx") or Q.tiled_rows("avx512", "amx") == 0:
        raise SystemExit("this CPU (or its OS) runs no AMX tiles: " + cpu_line())
    torch.set_num_threads(1)
    print(cpu_line() + f"; 1 thread; the amx build tiles from {Q.tiled_rows('avx512', 'amx')} rows")
    engines = {}
    for variant in BUILDS:
        with q8_build(variant):
            engines[variant] = LLM(None, num_threads=1, enable_prefix_caching=False)
    calls = integer_calls(engines["amx"].engine.runner.model)
    fns = {v: Q.q8_kernel("avx512", v) for v in BUILDS}
    generator = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=generator) for k in {c[5] for c in calls}} for m in args.rows}
    outs = {m: {n: torch.empty(m, n) for n in {c[6] for c in calls}} for m in args.rows}
    for m in args.rows:  # the same bits from both builds
        got = {}
        for v in BUILDS:
            products(fns[v], calls, xs[m], outs[m])
            got[v] = {n: o.clone() for n, o in outs[m].items()}
        assert all(torch.equal(got["amx"][n], got["vnni512"][n]) for n in got["amx"]), f"{m} rows: bits differ"
    prompts = chat_prompts(args.prompts, start=HELD_OUT_START)
    params = SamplingParams(temperature=0, max_tokens=1)
    best: dict = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for v in BUILDS:
                for m in args.rows:
                    best[v, m] = min(best.get((v, m), float("inf")), products(fns[v], calls, xs[m], outs[m]))
                start = time.thread_time()
                done = engines[v].chat(prompts, params, use_tqdm=False)
                best[v, "prefill"] = min(best.get((v, "prefill"), float("inf")), time.thread_time() - start)
    tokens = sum(len(o.prompt_token_ids) for o in done)
    print("\n| rows | vpdpbusd | AMX tiles | vpdpbusd / AMX |\n| --- | --- | --- | --- |")
    for m in args.rows:
        a, b = best["vnni512", m], best["amx", m]
        print(f"| {m} | {a * 1e3:.1f} ms ({a * 1e3 / m:.2f} ms/row) | {b * 1e3:.1f} ms ({b * 1e3 / m:.2f} ms/row) "
              f"| {a / b:.2f}x |")
    a, b = best["vnni512", "prefill"], best["amx", "prefill"]
    print(f"| prefill, {args.prompts} prompts, {tokens} tokens | {tokens / a:.0f} tok/s | {tokens / b:.0f} tok/s "
          f"| {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
