"""N-gram speculative decoding vs no speculation, in eyas and in HF transformers, in one run.

Two prompt sets, both real ShareGPT text in the model's chat template:

* ``copy``: edit-style requests whose answer mostly repeats the prompt (:func:`copy_prompts`),
  the case prompt lookup is built for;
* ``chat``: ordinary opening requests (:func:`chat_prompts`), where drafts rarely match.

For each set and batch size B, greedily, stopping at EOS or ``--max-tokens``:

* eyas plain vs eyas ``speculative_config={"method": "ngram", ...}`` (one LLM each, prefix
  caching off): tokens/s, speedup, mean acceptance length (accepted + 1 per verification step
  that carried drafts, summed over the requests' ``spec_metrics``), and how many speculative
  outputs equal the plain ones token for token (greedy speculation must change nothing);
* HF plain ``generate(do_sample=False)`` vs ``generate(..., prompt_lookup_num_tokens=k)``, with
  the model's EOS ids; HF's prompt lookup is batch-1 only, so for B > 1 it is "n/a".

B = 1 runs the first ``--batch1-prompts`` prompts one request at a time and sums tokens and
times, so batch-1 numbers are not one prompt's luck; B > 1 is one call on the first B prompts.
tokens/s = generated tokens (EOS included) / wall time of the calls (prefill included). Each
engine gets untimed warm-up calls first; each measurement is then taken ``--repeats`` times,
plain and speculative runs taking turns, and the fastest run of each counts. Ratios matter;
absolute numbers on a shared machine mean little.

    python benchmarks/bench_spec.py                                  # fp32, 1 thread, B = 1,8
    python benchmarks/bench_spec.py --max-tokens 32 --num-prompts 2  # quick check
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from bench_common import batch_sizes

# run as a script, benchmarks/ is on sys.path
from bench_engine import DTYPES, cpu_bf16_note

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.prompts import chat_prompts, copy_prompts
from eyas.model.resolve import resolve_model

PROMPT_SETS = {"copy": copy_prompts, "chat": chat_prompts}
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2-135M)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads for eyas and HF alike")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8", help="comma-separated, e.g. 1,8")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens per prompt (EOS stops earlier)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens (HF: prompt_lookup_num_tokens)")
    p.add_argument("--lookup-min", type=int, default=2, help="eyas prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=4, help="eyas prompt_lookup_max (HF: max_matching_ngram_size)")
    p.add_argument("--row-cost", type=float, default=None,
                   help="eyas speculative_config draft_row_cost (default: the engine's for the device)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set; a larger B runs at this size")
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="B = 1 runs this many prompts one at a time (capped at --num-prompts)")
    p.add_argument("--hf-batch1-prompts", type=int, default=None,
                   help="as --batch1-prompts, for HF only (default: the same), when HF is too slow")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each measurement, interleaved; the fastest counts")
    p.add_argument("--skip-hf", action="store_true", help="time eyas only")
    args = p.parse_args(argv)
    for name in ("threads", "max_tokens", "k", "num_prompts", "batch1_prompts", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    args.clipped = [b for b in args.batch_sizes if b > args.num_prompts]
    args.batch_sizes = sorted({min(b, args.num_prompts) for b in args.batch_sizes})
    args.batch1_prompts = min(args.batch1_prompts, args.num_prompts)
    args.hf_batch1_prompts = min(args.hf_batch1_prompts or args.batch1_prompts, args.num_prompts)
    return args


@dataclass
class Run:
    """One measurement: summed over the calls it took (B calls of one prompt, or one of B)."""

    tokens: int
    seconds: float
    ids: list[list[int]]
    spec_steps: int = 0
    spec_accepted: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification step that carried drafts (accepted + 1)."""
        return (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 1.0


def render(llm: LLM, conversations: list[list[dict]]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]


def batches(prompts: list[list[int]], b: int, batch1_prompts: int) -> list[list[list[int]]]:
    """B = 1: the first ``batch1_prompts`` prompts one call each; else one call on the first B."""
    return [[p] for p in prompts[:batch1_prompts]] if b == 1 else [prompts[:b]]


def fastest(repeats: int, *timers: Callable[[], Run]) -> list[Run]:
    """Each timer's fastest of ``repeats`` runs. The timers take turns (A, B, A, B, ...), so a slow
    spell on the shared machine hits them alike instead of skewing one side of a ratio."""
    best: list[Run | None] = [None] * len(timers)
    for _ in range(repeats):
        for i, timer in enumerate(timers):
            run = timer()
            if best[i] is None or run.seconds < best[i].seconds:
                best[i] = run
    return best


def time_eyas(llm: LLM, calls: list[list[list[int]]], max_tokens: int) -> Run:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False)
    run = Run(0, 0.0, [])
    for prompts in calls:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        run.seconds += time.perf_counter() - t0
        for o in outs:
            run.ids.append(o.outputs[0].token_ids)
            run.tokens += len(o.outputs[0].token_ids)
            run.spec_steps += o.spec_metrics.get("num_steps", 0)
            run.spec_accepted += o.spec_metrics.get("num_accepted", 0)
    return run


def time_hf(model, calls: list[list[list[int]]], max_tokens: int, eos: list[int], lookup: dict | None) -> Run:
    """Greedy ``generate`` (left padding for B > 1); tokens counted up to and with the first EOS."""
    run = Run(0, 0.0, [])
    for prompts in calls:
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), eos[0], dtype=torch.long)  # [B, width]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos[0],
                                 use_cache=True, temperature=None, top_p=None, top_k=None, **(lookup or {}))
        run.seconds += time.perf_counter() - t0
        for row in out[:, width:].tolist():  # [B, new]; rows that stopped early are padded with EOS
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            run.ids.append(row[:n])
            run.tokens += n
    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}; {cpu_bf16_note()}")

    model_path = resolve_model(args.model)
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max, "draft_row_cost": args.row_cost}
    common = {"dtype": args.dtype, "num_threads": args.threads, "enable_prefix_caching": False,
              "max_num_seqs": max(64, max(args.batch_sizes))}
    plain = LLM(args.model, **common)
    ngram = LLM(args.model, speculative_config=spec, **common)
    eos = list(ModelConfig.from_folder(model_path).eos_token_ids)
    hf_lookup = {"prompt_lookup_num_tokens": args.k, "max_matching_ngram_size": args.lookup_max}

    sets = {name: render(plain, make(args.num_prompts)) for name, make in PROMPT_SETS.items()}
    warmup = render(plain, chat_prompts(args.num_prompts + max(args.batch_sizes))[args.num_prompts:])

    hf = None
    if not args.skip_hf:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()

    print(f"model {model_path}; eos {eos}; greedy, up to {args.max_tokens} new tokens (EOS stops earlier)")
    print(f"eyas ngram: k={args.k}, lookup n-grams {args.lookup_min}-{args.lookup_max}, draft_row_cost "
          f"{ngram.engine.scheduler.draft_row_cost}; prefix caching off. "
          f"HF: prompt_lookup_num_tokens={args.k}, max_matching_ngram_size={args.lookup_max} "
          f"(HF tries n-grams {args.lookup_max} down to 1)")
    print(f"B=1: first {args.batch1_prompts} prompts one at a time (HF: {args.hf_batch1_prompts}), summed; "
          f"B>1: one call on the first B of {args.num_prompts} prompts per set")
    if args.clipped:
        print(f"batch sizes {args.clipped} exceed --num-prompts {args.num_prompts}: run at B={args.num_prompts}")
    for name, prompts in sets.items():
        print(f"  {name}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")

    for b in sorted({1, *args.batch_sizes}):  # untimed warm-up at every measured shape
        time_eyas(plain, batches(warmup, b, 1), WARMUP_TOKENS)
        time_eyas(ngram, batches(warmup, b, 1), WARMUP_TOKENS)
        if hf is not None:
            time_hf(hf, batches(warmup, b, 1), WARMUP_TOKENS, eos, None)
            if b == 1:
                time_hf(hf, batches(warmup, b, 1), WARMUP_TOKENS, eos, hf_lookup)

    head = (f"{'set':<5} {'B':>3} {'eyas tok/s':>10} {'ngram tok/s':>11} {'speedup':>7} {'acc len':>7} {'drafted':>7} "
            f"{'identical':>9} {'HF tok/s':>9} {'lookup tok/s':>12} {'HF speedup':>10} {'tokens eyas/HF':>15}")
    print("\n" + head)
    differ = []  # (set, B, identical, total) where speculation changed an output
    for name, prompts in sets.items():
        for b in args.batch_sizes:
            calls = batches(prompts, b, args.batch1_prompts)
            base, fast = fastest(args.repeats, partial(time_eyas, plain, calls, args.max_tokens),
                                 partial(time_eyas, ngram, calls, args.max_tokens))
            same = sum(x == y for x, y in zip(base.ids, fast.ids))
            if same < len(base.ids):
                differ.append(f"{name} B={b}: {same}/{len(base.ids)}")
            row = (f"{name:<5} {b:>3} {base.tok_s:>10.1f} {fast.tok_s:>11.1f} {fast.tok_s / base.tok_s:>6.2f}x "
                   f"{fast.acceptance_length:>7.2f} {fast.spec_accepted / fast.tokens:>7.0%} "
                   f"{f'{same}/{len(base.ids)}':>9}")
            if hf is None:
                print(f"{row} {'-':>9} {'-':>12} {'-':>10} {'-':>15}", flush=True)
                continue
            hf_calls = batches(prompts, b, args.hf_batch1_prompts)
            hf_timers = [partial(time_hf, hf, hf_calls, args.max_tokens, eos, None)]
            if b == 1:  # HF's prompt lookup is batch-1 only
                hf_timers.append(partial(time_hf, hf, hf_calls, args.max_tokens, eos, hf_lookup))
            hf_base, *hf_lookup_run = fastest(args.repeats, *hf_timers)
            eyas_tokens = base.tokens if hf_calls == calls else sum(map(len, base.ids[: len(hf_base.ids)]))
            if hf_lookup_run:
                tok_s = hf_lookup_run[0].tok_s
                hf_cols = f"{tok_s:>12.1f} {tok_s / hf_base.tok_s:>9.2f}x"
            else:
                hf_cols = f"{'n/a':>12} {'n/a':>10}"
            print(f"{row} {hf_base.tok_s:>9.1f} {hf_cols} {f'{eyas_tokens}/{hf_base.tokens}':>15}", flush=True)

    print("tok/s = generated tokens (EOS included) / wall time of the generate calls (prefill included); "
          f"fastest of {args.repeats} interleaved runs each; speedup = ngram / plain tok/s;\n"
          "acc len = mean acceptance length (accepted drafts + 1 per "
          "verification step that carried drafts); drafted = share of ngram's tokens that were accepted "
          "drafts;\nidentical = eyas ngram outputs equal to eyas plain, token for "
          "token (must be all);\ntokens eyas/HF = tokens each system generated without speculation (over "
          "HF's prompts; lengths may differ slightly, so compare tok/s)")
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    if differ:
        print(f"FAIL: greedy ngram outputs differ from plain ones ({'; '.join(differ)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
