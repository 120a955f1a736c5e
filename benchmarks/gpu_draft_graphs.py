"""CUDA graphs of the draft steps: one draft step with graphs against eager, on a GPU.

The target is a random Llama of SmolLM2-135M's shape (``gpu_smoke.random_smollm2_shape``; a lent
GPU box has no default-model package), the drafters are random (``bench_drafters.make_drafters``:
EAGLE-1, EAGLE-3 with a 16k draft vocabulary, one-layer MTP) or the target's first 4 layers
(``draft_model`` self-speculation), bf16, random 200-token prompts,
greedy, ``--max-tokens`` new tokens, EOS ignored, k = 3. For each method and batch size:

* draft step = CUDA-synchronised time inside ``propose`` per step / k, with graphs (default) and
  with ``enforce_eager=True``, and their ratio;
* the same relative to the target's decode step (median ``time_per_output_token`` of plain runs);
* end-to-end tokens/s of both, and the shares of steps whose drafts and of requests whose outputs
  are identical (the target is graphed too, and bf16 kernels over padded shapes may round
  differently; float32 equality is a test, ``tests/test_cuda_graphs.py``).

    python benchmarks/gpu_draft_graphs.py --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import batch_sizes
from bench_drafters import make_drafters
from gpu_smoke import random_smollm2_shape

from eyas import LLM, SamplingParams


def _timed_run(llm: LLM, prompts, params) -> tuple[float, float, list, list]:
    """(median propose time per step, tokens/s, per-step drafts, outputs)."""
    proposer = llm.engine.runner.proposer
    timings, steps, original = [], [], proposer.propose

    def timed(inp):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = original(inp)
        torch.cuda.synchronize()
        if inp.sample_rows:
            timings.append(time.perf_counter() - start)
            steps.append(out.draft_token_ids.tolist())
        return out

    proposer.propose = timed
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    proposer.propose = original
    return statistics.median(timings), tps, steps, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8,32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    root = Path(tempfile.mkdtemp())
    target = random_smollm2_shape(root / "target")
    methods = {**make_drafters(target, root), "self4": {"method": "draft_model", "draft_num_layers": 4}}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (200,), generator=g).tolist() for _ in range(max(args.batch_sizes) + 2)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(dtype="bfloat16", device="cuda", max_model_len=1024, kv_cache_gb=2.0, enable_prefix_caching=False)
    plain = LLM(str(target), **common)
    decode = {}
    for b in args.batch_sizes:
        plain.generate(prompts[:b], warm, use_tqdm=False)
        outs = plain.generate(prompts[:b], params, use_tqdm=False)
        decode[b] = statistics.median(o.metrics.time_per_output_token for o in outs)
    print(f"{torch.cuda.get_device_name()}, bf16, random SmolLM2-135M-shaped target and drafters, k={args.k}, "
          f"{args.max_tokens} new tokens; target decode step: "
          + ", ".join(f"B={b} {decode[b] * 1e3:.2f} ms" for b in args.batch_sizes))
    print(f"{'method':7s} {'B':>3s} {'graphs':>9s} {'eager':>9s} {'speedup':>8s} {'/decode g':>10s} "
          f"{'/decode e':>10s} {'tok/s g':>8s} {'tok/s e':>8s} {'same drafts':>12s} {'same outputs':>13s}")
    for name, spec in methods.items():
        path = spec.pop("target", str(target))
        spec = {**spec, "num_speculative_tokens": args.k, "adaptive_draft_length": False}
        llms = {eager: LLM(path, **common, enforce_eager=eager, speculative_config=dict(spec))
                for eager in (False, True)}
        for b in args.batch_sizes:
            res = {}
            for eager, llm in llms.items():
                llm.generate(prompts[-1:] * b, params, use_tqdm=False)  # captures the graphs this run needs
                res[eager] = _timed_run(llm, prompts[:b], params)
            (tg, tpsg, dg, og), (te, tpse, de, oe) = res[False], res[True]
            same = sum(x == y for x, y in zip(dg, de)) / max(len(dg), 1)
            same_out = sum(x == y for x, y in zip(og, oe)) / len(og)
            print(f"{name:7s} {b:3d} {tg / args.k * 1e3:7.3f}ms {te / args.k * 1e3:7.3f}ms {te / tg:7.2f}x "
                  f"{tg / args.k / decode[b]:9.2f}x {te / args.k / decode[b]:9.2f}x {tpsg:8.1f} {tpse:8.1f} "
                  f"{same:11.0%} {same_out:12.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
