"""Suffix decoding in front of the shipped EAGLE-3 drafter (``enable_suffix_decoding``) on bench_spec's
repetitive code workload at batch 1, beside suffix decoding alone and no speculation, in one run.

The code workload is ``bench_spec.py``'s (HumanEval-style stubs written for that benchmark, each asked once per
seed, sampled at temperature 0.2, top_p 0.95, in rounds), so neither the drafter's training data nor its held-out
chat prompts are involved; ``bench_drafters.py --suffix`` measures the same engines on held-out chat prompts.
Every speculative engine verifies with shared noise, so its outputs must equal the plain ones token for token.
Each speculative run starts from a fresh engine (an empty global tree, warmed up with a one-token request); the
engines take turns ``--repeats`` times and the fastest run of each counts (``bench_spec.fastest``).

    python benchmarks/bench_suffix_hybrid.py                       # 1 thread, 5 tasks x 4 seeds, 128 tokens
    python benchmarks/bench_suffix_hybrid.py --code-batch1-tasks 2 --code-seeds 2 --repeats 1   # quick check
"""

from __future__ import annotations

import shlex
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import cpu_line  # noqa: E402
from bench_spec import fastest, parse_args, render, time_eyas, time_fresh, workloads  # noqa: E402

from eyas import LLM, SamplingParams  # noqa: E402
from eyas.data.prompts import chat_prompts  # noqa: E402

ENGINES = {  # name -> speculative_config, all verifying with shared noise
    "suffix": {"method": "suffix"},
    "eagle3": {"method": "eagle3"},
    "eagle3 + suffix": {"method": "eagle3", "enable_suffix_decoding": True},
    "eagle3 + suffix, every draft": {"method": "eagle3", "enable_suffix_decoding": True,
                                     "adaptive_draft_length": False},
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("command:", shlex.join(["python", *sys.argv]))
    print(f"{cpu_line()}; {args.threads} thread(s)")
    torch.set_num_threads(args.threads)
    common = {"dtype": args.dtype, "num_threads": args.threads, "enable_prefix_caching": False, "max_num_seqs": 64}
    plain = LLM(args.model, **common)
    code = next(w for w in workloads(plain, args) if w.name == "code")
    warmup = render(plain, chat_prompts(1))[0]
    plain.generate([warmup], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    calls = code.calls(1)
    print(f"code: {len(calls)} requests one at a time, temperature 0.2, top_p 0.95, up to {args.max_tokens} tokens")
    makers = [partial(LLM, args.model, speculative_config={**spec, "verification": "shared_noise"}, **common)
              for spec in ENGINES.values()]
    base, *runs = fastest(args.repeats, partial(time_eyas, plain, code, calls),
                          *[partial(time_fresh, make, warmup, None, code, calls) for make in makers])
    print(f"{'engine':<30} {'tok/s':>7} {'speedup':>8} {'acc len':>8} {'identical':>10}")
    print(f"{'plain':<30} {base.tok_s:7.1f}")
    failed = False
    for name, run in zip(ENGINES, runs):
        same = sum(a == b for a, b in zip(base.ids, run.ids))
        failed |= same < len(base.ids)
        print(f"{name:<30} {run.tok_s:7.1f} {run.tok_s / base.tok_s:7.2f}x {run.acceptance_length:8.2f} "
              f"{same:>5}/{len(base.ids)}")
    if failed:
        print("FAIL: speculative outputs differ from plain ones")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
