"""The default model's matrix products alone, per matmul precision, at 1, 5 and 16 rows on one thread: what a
decode step (1 row) and a verification (5, 16 rows) spend in the weight kernels, and how close one row comes to
the read bandwidth; beside them, the engine's whole batch-1 decode step at each precision, so the share of a step
spent outside the products shows.

Every ``QuantLinear`` of the GGUF model in forward order, once per pass, on random activations; the precisions and
row counts interleaved for ``--rounds`` rounds and the fastest pass of each kept. Time is the thread's CPU time
(``time.thread_time``): on a machine shared with other jobs a pass is then not charged for the time its core ran
something else, while waiting on memory still counts. "low" is set the way the engine sets it (q/k/v products on
activations split in two int8 rows, the Q4_0 / Q4_1 / Q8_0 weights interleaved). A second table splits each pass by
kind of product (q/k/v, o, gate/up, down, LM head). The decode step: an engine at that precision generates
1 and 33 tokens greedily from the same 64-token prompt, and a step is the difference over 32, by CPU time too.

    python benchmarks/bench_products.py [--precisions highest,medium,low] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import cpu_line
from bench_cpu import read_bandwidth_gbs

from eyas import LLM, SamplingParams
from eyas.model import quantized as Q
from eyas.model.loader import set_matmul_precision

ROWS = (1, 5, 16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="highest,medium,low")
    p.add_argument("--rounds", type=int, default=7)
    return p.parse_args(argv)


def decode_step(llm: LLM) -> float:
    """Thread CPU seconds of one batch-1 decode step: (33 tokens - 1 token) / 32 from the same prompt."""
    prompt = list(range(1000, 1064))
    spent = []
    for tokens in (1, 33):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.thread_time()
        llm.generate([prompt], params, use_tqdm=False)
        spent.append(time.thread_time() - start)
    return (spent[1] - spent[0]) / 32


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    precisions = [p for p in args.precisions.split(",") if Q.kernel_available(p)]
    print(cpu_line() + "; 1 thread; q8_gemm.c's integer products: " + Q.dot_products())
    model = LLM(None, quantization="gguf", matmul_precision="highest", max_model_len=128,
                kv_cache_gb=0.02).engine.runner.model
    products = [(name, m) for name, m in model.named_modules() if isinstance(m, Q.QuantLinear)]
    nbytes = sum(p.data.numel() for _, m in products for p in m.parts)
    generator = torch.Generator().manual_seed(0)
    inputs = {n: {k: torch.randn(n, k, generator=generator) for k in {m.in_features for _, m in products}} for n in ROWS}
    bandwidth = read_bandwidth_gbs(1, clock=time.thread_time)
    print(f"weight bytes of a pass: {nbytes / 1e6:.1f} MB; one-thread read bandwidth (CPU time): {bandwidth:.1f} GB/s")
    engines = {p: LLM(None, quantization="gguf", matmul_precision=p, num_threads=1, max_model_len=128,
                      kv_cache_gb=0.02, enable_prefix_caching=False) for p in precisions}
    best, by_kind = {}, {}  # (precision, rows) -> the fastest pass's seconds; that pass's seconds per kind of product
    with torch.inference_mode():
        for _ in range(args.rounds):
            for precision in precisions:
                best[precision, "step"] = min(best.get((precision, "step"), float("inf")),
                                              decode_step(engines[precision]))
                set_matmul_precision(model, precision)
                for n in ROWS:
                    spent = {}
                    for name, m in products:
                        x = inputs[n][m.in_features]
                        start = time.thread_time()
                        m(x)
                        kind = name.rsplit(".", 1)[-1]
                        spent[kind] = spent.get(kind, 0.0) + time.thread_time() - start
                    if sum(spent.values()) < best.get((precision, n), float("inf")):
                        best[precision, n], by_kind[precision, n] = sum(spent.values()), spent
    print("\n| precision | " + " | ".join(f"{n} row{'s' * (n > 1)}" for n in ROWS)
          + " | highest / this at " + ", ".join(map(str, ROWS)) + " | 1 row: GB/s, of bandwidth "
          + "| decode step (products' share) |")
    print("| --- " * (len(ROWS) + 4) + "|")
    for precision in precisions:
        times = [best[precision, n] for n in ROWS]
        cells = [f"{t * 1e3:.2f} ms ({t / times[0]:.2f}x)" for t in times]
        vs = ", ".join(f"{best['highest', n] / best[precision, n]:.2f}" for n in ROWS) if "highest" in precisions else "-"
        rate = nbytes / times[0] / 1e9
        step = best[precision, "step"]
        print(f"| {precision} | " + " | ".join(cells) + f" | {vs} | {rate:.1f}, {rate / bandwidth:.0%} "
              f"| {step * 1e3:.2f} ms ({times[0] / step:.0%}) |")
    kinds = list(by_kind[precisions[0], 1])
    weight_mb = {k: sum(p.data.numel() for name, m in products if name.endswith(k) for p in m.parts) / 1e6 for k in kinds}
    print("\nBy kind of product, the fastest pass's ms (share of the pass); weight MB beside each kind:")
    print("| precision | rows | " + " | ".join(f"{k} ({weight_mb[k]:.1f} MB)" for k in kinds) + " |")
    print("| --- " * (len(kinds) + 2) + "|")
    for precision in precisions:
        for n in ROWS:
            spent = by_kind[precision, n]
            total = sum(spent.values())
            print(f"| {precision} | {n} | " + " | ".join(f"{spent[k] * 1e3:.2f} ({spent[k] / total:.0%})" for k in kinds)
                  + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
