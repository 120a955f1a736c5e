"""What one more row of a forward costs on this CPU, per weight format: the whole step's curve, beside the
curve the scheduler prices drafts with (``eyas/runner/row_cost.py``: the target's products, and its attention per
key, measured once per CPU and kept in the cache folder).

A speculative step verifies k drafts as k + 1 rows of one request; it pays when the accepted drafts
cover what the extra rows cost. This times the engine's step with n new rows on a cached prefix
(prefix caching on, one request of a ``--prefix``-token prompt already cached, 192 by default, then n more tokens and one
sampled token: the shape of a verification of n - 1 drafts), for each n and each weight format, the
n interleaved and the median of ``--repeats`` taken. It prints each n's time as a multiple of the
one-row step, below it the scheduler's recorded curve for the products ("products"), and that curve with the
recorded attention at these contexts, as the scheduler prices a request of prefix + n keys ("+ attention"), and the
slope c of
the line (1 + c * n) / (1 + c) fitted by least squares over the measured n (what
``speculative_config={"draft_row_cost": c}`` sets).

    python benchmarks/bench_row_cost.py [--modes gguf,int8,bf16,none] [--threads 2]   # the default precision
    python benchmarks/bench_row_cost.py --modes gguf@highest,gguf@medium,gguf@low   # float32 / bf16 / int8 products
    python benchmarks/bench_row_cost.py --modes gguf@low --threads 1 --prefix 2000   # a long context: attention
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench_common import cpu_line, weight_mode

from eyas import LLM, SamplingParams
from eyas.spec_decode.adaptive import RowCost

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="gguf,int8,bf16,none", help="quantization modes (none = the engine dtype); "
                   "MODE@highest, MODE@medium or MODE@low for that matmul precision (default: auto)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--prefix", type=int, default=192, help="cached prompt tokens before the n rows (whole blocks of "
                   "16 are cached)")
    return p.parse_args(argv)


def step_times(mode: dict, threads: int, repeats: int, prefix_len: int) -> tuple[dict[int, float], RowCost]:
    """Median seconds of a step with n new rows, for each n of ROWS, and the scheduler's recorded curve for the
    engine's weights; ``mode``: ``weight_mode``'s LLM arguments."""
    llm = LLM(None, num_threads=threads, max_model_len=prefix_len + 64, enable_prefix_caching=True, **mode)
    recorded = llm.engine.runner.measured_row_cost()
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(prefix_len)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prefix + [5]], one, use_tqdm=False)  # caches the prefix
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for _ in range(repeats):
        for n in ROWS:
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}, recorded


def fitted_slope(ratios: dict[int, float]) -> float:
    """The c of (1 + c * n) / (1 + c) closest to the ratios (least squares over a grid of 0.001)."""
    def error(c: float) -> float:
        return sum(((1 + c * n) / (1 + c) - r) ** 2 for n, r in ratios.items())
    return min((i / 1000 for i in range(1001)), key=error)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"{cpu_line()}; {args.threads} thread(s)")
    print(f"{'mode':<12} one-row step  " + "  ".join(f"{n:>4}" for n in ROWS) + "  fitted c")
    for spec in args.modes.split(","):
        times, recorded = step_times(weight_mode(spec), args.threads, args.repeats, args.prefix)
        ratios = {n: t / times[1] for n, t in times.items()}
        print(f"{spec:<12} {times[1] * 1e3:9.2f} ms  " + "  ".join(f"{ratios[n]:4.2f}" for n in ROWS)
              + f"  {fitted_slope(ratios):8.3f}")
        print(f"{'':<12} {'products':>12}  " + "  ".join(f"{recorded(n):4.2f}" for n in ROWS))
        one = recorded(1) + recorded.attention(args.prefix + 1, 1)
        print(f"{'':<12} {'+ attention':>12}  "
              + "  ".join(f"{(recorded(n) + recorded.attention(args.prefix + n, n)) / one:4.2f}" for n in ROWS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
