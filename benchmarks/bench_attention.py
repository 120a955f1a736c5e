"""Attention on the CPU: eyas's C kernel against torch's scaled_dot_product_attention, one layer.

The shape of the default model (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64), a float32 paged
KV cache of 16-token blocks, B requests each with its last ``--query-len`` tokens as queries (1: a decode; 5: a
verification of 4 drafts; equal to the context: a prefill) over ``--contexts`` keys. Both backends
read the same cache through the same block tables: ``cpu`` (the C kernel, eyas's default on a CPU) and
``sdpa`` (eyas's fallback: each request's keys gathered, then torch's scaled_dot_product_attention).
Per batch size and context, the median time of one layer's attention over ``--repeats`` interleaved
calls, the rate it reads the K/V it attends over, and the ratio. A decode step of the default model
runs 30 such layers, each over its own cache, one after another: a call here is ``--layers`` layers, each
with its own cache (30 by default, so a layer's K/V come from memory as in a step; ``--layers 1`` repeats
one cache, which stays in the CPU's caches when it fits), and the time shown is a layer's share.

    python benchmarks/bench_attention.py [--threads 2] [--batch-sizes 1,16] [--contexts 256,512,1024] [--layers 30]
        [--query-len 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import cpu_line

from eyas.model.attention import AttentionBatch, get_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def query_batch(batch: int, context: int, q_len: int, gen: torch.Generator) -> tuple[AttentionBatch, int]:
    """B requests querying positions context - q_len .. context - 1 each, over shuffled blocks (as a long-running
    engine's are)."""
    per = -(-context // BLOCK)
    blocks = torch.randperm(batch * per + 1, generator=gen)[:batch * per].view(batch, per)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    positions = torch.arange(context - q_len, context)
    slots = (blocks[:, positions // BLOCK] * BLOCK + positions % BLOCK).reshape(-1)  # [B * q_len]
    return AttentionBatch(torch.arange(batch + 1, dtype=torch.int64) * q_len, seq_lens, blocks, slots, BLOCK, q_len,
                          context), batch * per + 1


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=_ints, default="1,16")
    p.add_argument("--contexts", type=_ints, default="256,512,1024")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--layers", type=int, default=30, help="layers a call runs, each over its own cache")
    p.add_argument("--query-len", type=int, default=1, help="query tokens a request (at most the context)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}; {args.threads} thread(s); {args.layers} layer(s) a call, each its own cache; "
          f"{args.query_len} query token(s) a request")
    backends = {name: get_backend(name) for name in ("cpu", "sdpa")}
    print(f"{'B':>3} {'keys':>5} {'K/V MB':>7} {'C kernel us':>11} {'GB/s':>5} {'sdpa us':>8} {'GB/s':>5} {'sdpa / C':>8}")
    gen = torch.Generator().manual_seed(0)
    for b in args.batch_sizes:
        for context in args.contexts:
            if not 1 <= args.query_len <= context:
                raise SystemExit(f"--query-len: {args.query_len} must be in [1, {context}] (a context)")
            batch, num_blocks = query_batch(b, context, args.query_len, gen)
            caches = [torch.randn(2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(args.layers)]
            q = torch.randn(b * args.query_len, HEADS, HEAD_DIM, generator=gen)
            k, v = (torch.randn(b * args.query_len, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
            metas = {name: be.build_metadata(batch, torch.device("cpu")) for name, be in backends.items()}
            times: dict[str, list[float]] = {name: [] for name in backends}
            outs = {}
            for _ in range(args.repeats):
                for name, be in backends.items():
                    start = time.perf_counter()
                    for cache in caches:
                        outs[name] = be.forward(q, k, v, cache, metas[name])
                    times[name].append((time.perf_counter() - start) / len(caches))
            torch.testing.assert_close(outs["cpu"], outs["sdpa"], rtol=1e-4, atol=1e-5)
            mb = 2 * b * context * KV_HEADS * HEAD_DIM * 4 / 1e6
            t = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            print(f"{b:3d} {context:5d} {mb:7.1f} {t['cpu']:11.0f} {mb / t['cpu'] * 1e3:5.1f} {t['sdpa']:8.0f} "
                  f"{mb / t['sdpa'] * 1e3:5.1f} {t['sdpa'] / t['cpu']:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
