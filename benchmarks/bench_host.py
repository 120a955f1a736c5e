"""The engine's host work per request and step at large batches, eyas vs HF transformers, in one run.

A tiny random Llama (3 layers of width 64, a 320-token vocabulary) makes the forward nearly free, so what is
left is each engine's own work around it: scheduling, block tables, sampling bookkeeping, detokenizing,
building outputs. That work decides a small model's throughput on a GPU at large batches (where eyas
regenerates training replies for its drafters) long before the forward does. Each engine samples
``--max-tokens`` tokens (temperature 0.8, EOS ignored) for B prompts at once, after an untimed run of the same
shape; ``--repeats`` timed runs, engines taking turns, the fastest counts. Printed per B: tokens/s of both,
eyas's time per step, its forward per step (timed around ``ModelRunner.forward``) and the rest per request
and step.

    python benchmarks/bench_host.py                     # B = 64,256,512, 2 threads
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_common import batch_sizes, cpu_line  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402  (the tests' tiny random Llama and byte-level tokenizer)

from eyas import LLM, SamplingParams  # noqa: E402


def measure(folder: Path, hf, b: int, args) -> str:
    """One row of the table: B prompts of 4 tokens, each engine's fastest of ``args.repeats`` runs."""
    llm = LLM(str(folder), max_num_seqs=b, max_num_batched_tokens=max(2048, 8 * b), num_threads=args.threads,
              enable_prefix_caching=False, kv_cache_gb=0.25)
    forwards: list[float] = []
    forward = llm.engine.runner.forward

    def timed(*a, **kw):
        start = time.perf_counter()
        out = forward(*a, **kw)
        forwards.append(time.perf_counter() - start)
        return out

    llm.engine.runner.forward = timed
    prompts = [[1 + i % 200, 5, 7, 9] for i in range(b)]
    params = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    ids = torch.tensor(prompts)

    def run_eyas() -> tuple[float, int, float]:
        forwards.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, len(forwards), sum(forwards)

    def run_hf() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                        max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=0)
        return time.perf_counter() - start

    run_eyas(), run_hf()  # warm-up
    eyas, hf_seconds = (float("inf"), 1, 0.0), float("inf")
    for _ in range(args.repeats):  # taking turns
        eyas = min(eyas, run_eyas())
        hf_seconds = min(hf_seconds, run_hf())
    llm.close()
    seconds, steps, fwd = eyas
    tokens = b * args.max_tokens
    return (f"{b:>4} {tokens / seconds:>10.0f} {tokens / hf_seconds:>9.0f} {hf_seconds / seconds:>6.2f}x "
            f"{1e3 * seconds / steps:>7.2f}ms {1e3 * fwd / steps:>6.2f}ms {1e6 * (seconds - fwd) / steps / b:>18.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=batch_sizes, default="64,256,512")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    folder = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print(f"{'B':>4} {'eyas tok/s':>10} {'HF tok/s':>9} {'eyas/HF':>7} {'eyas step':>9} {'forward':>8} "
          f"{'rest per request-step':>21}")
    for b in args.batch_sizes:
        print(measure(folder, hf, b, args), flush=True)


if __name__ == "__main__":
    main()
