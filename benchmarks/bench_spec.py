"""N-gram and suffix speculative decoding vs no speculation in eyas (and HF transformers' prompt lookup), in one run.

Three workloads, all in the model's chat template:

* ``chat``: ordinary ShareGPT opening requests (:func:`chat_prompts`), greedy; drafts rarely match;
* ``copy``: ShareGPT edit-style requests whose answer mostly repeats the prompt (:func:`copy_prompts`),
  greedy; the case prompt lookup is built for;
* ``code``: HumanEval-style function stubs (``code_tasks.json``: 20 signatures with docstrings and
  doctests written for this benchmark), each asked ``--code-seeds`` times with a different seed,
  sampled as HumanEval's pass@1 is (temperature 0.2, top_p 0.95), in rounds: every task once, then
  every task again, ... Later rounds repeat what earlier answers said, which suffix decoding's global
  tree of earlier outputs learns from.

Engines: plain; ``ngram`` (k = ``--k``, n-grams ``--lookup-min``..``--lookup-max``); ``suffix`` (vLLM's
defaults: tree depth 24, factor 1, min token prob 0.1, k = 12, the longest draft those allow). Both
speculative engines verify with shared-noise matching, so every output must equal the plain one token
for token, greedy and sampled alike (the script prints FAIL and exits 1 otherwise). Prefix caching is
off everywhere.

B = 1 runs requests one at a time (chat, copy: the first ``--batch1-prompts`` prompts; code: every
round of the first ``--code-batch1-tasks`` tasks) and sums tokens and times. B > 1: chat and copy
make one call on the first B prompts; code runs all its requests in calls of B, in round order.
tokens/s = generated tokens (EOS included) / wall time of the calls (prefill included). Each engine
gets untimed warm-up calls at every measured shape; each measurement is then taken ``--repeats``
times, the engines taking turns, and the fastest run of each counts. A suffix measurement starts
from a fresh engine every time (warmed up with a one-token request), so no run drafts from an earlier
run's outputs; within a run the global tree learns from the run's own earlier requests.

It also times the suffix structure at the largest B: time inside the proposer per step (appending the
step's tokens to the request trees, matching, drafting) and per ended request (adding its output to
the global tree, evicting), against the target forward of the same steps.

HF transformers (chat and copy, greedy): plain ``generate`` vs ``generate(prompt_lookup_num_tokens=k)``,
batch 1 only for the lookup.

    python benchmarks/bench_spec.py                                       # fp32, 1 thread, B = 1,16
    python benchmarks/bench_spec.py --max-tokens 32 --num-prompts 2 --code-seeds 2 --skip-hf   # quick check
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from bench_common import batch_sizes, cpu_line

# run as a script, benchmarks/ is on sys.path
from bench_engine import DTYPES, cpu_bf16_note

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.prompts import chat_prompts, copy_prompts
from eyas.model.resolve import resolve_model

WARMUP_TOKENS = 8
CODE_TASKS = Path(__file__).with_name("code_tasks.json")
CODE_INSTRUCTION = "Complete this Python function. Reply with the whole function in one code block.\n\n```python\n{}```"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2-135M)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads for eyas and HF alike")
    p.add_argument("--matmul-precision", default="auto", choices=["auto", "highest", "medium", "low"],
                   help="eyas's products (medium: bfloat16, on AVX512-BF16 CPUs; auto: medium where it pays); "
                        "every eyas engine alike")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,16", help="comma-separated, e.g. 1,16")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens per request (EOS stops earlier)")
    p.add_argument("--k", type=int, default=8, help="ngram num_speculative_tokens (HF: prompt_lookup_num_tokens)")
    p.add_argument("--lookup-min", type=int, default=2, help="eyas prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=4, help="eyas prompt_lookup_max (HF: max_matching_ngram_size)")
    p.add_argument("--row-cost", type=float, default=None,
                   help="eyas speculative_config draft_row_cost (default: the engine's for the device)")
    p.add_argument("--num-prompts", type=int, default=16, help="chat and copy prompts; a larger B runs at this size")
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="chat and copy at B = 1: this many prompts one at a time (capped at --num-prompts)")
    p.add_argument("--code-tasks", type=int, default=20, help="code tasks used (of the 20 in code_tasks.json)")
    p.add_argument("--code-seeds", type=int, default=4, help="times each code task is asked, with seeds 0, 1, ...")
    p.add_argument("--code-batch1-tasks", type=int, default=5,
                   help="code at B = 1: every round of this many tasks, one request at a time")
    p.add_argument("--hf-batch1-prompts", type=int, default=None,
                   help="as --batch1-prompts, for HF only (default: the same), when HF is too slow")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each measurement, interleaved; the fastest counts")
    p.add_argument("--skip-hf", action="store_true", help="time eyas only")
    p.add_argument("--sets", default="chat,copy,code", help="workloads, comma-separated, of chat, copy, code")
    args = p.parse_args(argv)
    args.sets = args.sets.split(",")
    if not args.sets or set(args.sets) - {"chat", "copy", "code"}:
        p.error(f"--sets {','.join(args.sets)}: give some of chat, copy, code")
    for name in ("threads", "max_tokens", "k", "num_prompts", "batch1_prompts", "code_tasks", "code_seeds",
                 "code_batch1_tasks", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    args.batch1_prompts = min(args.batch1_prompts, args.num_prompts)
    args.hf_batch1_prompts = min(args.hf_batch1_prompts or args.batch1_prompts, args.num_prompts)
    args.code_tasks = min(args.code_tasks, len(json.loads(CODE_TASKS.read_text())))
    args.code_batch1_tasks = min(args.code_batch1_tasks, args.code_tasks)
    return args


@dataclass
class Workload:
    """Requests (prompt, params) and how a batch size groups them into ``generate`` calls."""

    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    batch1: list[int]  # requests run one at a time at B = 1
    spread: bool  # B > 1: every request in calls of B (else one call on the first B)

    def calls(self, b: int) -> list[list[int]]:
        if b == 1:
            return [[i] for i in self.batch1]
        if not self.spread:
            return [list(range(min(b, len(self.prompts))))]
        return [list(range(i, min(i + b, len(self.prompts)))) for i in range(0, len(self.prompts), b)]


@dataclass
class Run:
    """One measurement: summed over the calls it took."""

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


@dataclass
class Probe:
    """Seconds inside the suffix proposer per step that drafted and per ended request, and of the target
    forwards of the suffix engine and of the plain one over the same requests."""

    propose: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    plain_forward: list[float] = field(default_factory=list)

    def attach(self, llm: LLM) -> None:
        runner, proposer = llm.engine.runner, llm.engine.runner.proposer
        propose, ended, forward = proposer.propose, proposer.request_done, runner.forward

        def timed_propose(inp):
            start = time.perf_counter()
            out = propose(inp)
            if inp.request_ids:  # a step with sampling requests (not only prompt chunks)
                self.propose.append(time.perf_counter() - start)
            return out

        proposer.propose = timed_propose
        proposer.request_done = _timed(ended, self.ended)
        runner.forward = _timed(forward, self.forward)

    def line(self, name: str, b: int) -> str:
        steps = len(self.propose)
        ended = sum(self.ended) / steps  # global-tree inserts and evictions, spread over the steps
        propose = statistics.median(self.propose)
        forward, plain = statistics.median(self.forward), statistics.median(self.plain_forward)
        return (f"  {name} B={b}: propose median {propose * 1e3:.2f} ms/step (p90 "
                f"{sorted(self.propose)[int(0.9 * steps)] * 1e3:.2f}) + ended requests {ended * 1e3:.3f} ms/step "
                f"({len(self.ended)} in {steps} steps) = {(propose + ended) / forward:.1%} of the median target forward "
                f"{forward * 1e3:.1f} ms ({(propose + ended) / plain:.1%} of a plain engine's forward, "
                f"{plain * 1e3:.1f} ms)")


def _timed(fn: Callable, sink: list[float]) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out
    return timed


def render(llm: LLM, conversations: list[list[dict]]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]


def workloads(llm: LLM, args) -> list[Workload]:
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    out = []
    for name, make in (("chat", chat_prompts), ("copy", copy_prompts)):
        if name not in args.sets:
            continue
        prompts = render(llm, make(args.num_prompts))
        out.append(Workload(name, prompts, [greedy] * len(prompts), list(range(args.batch1_prompts)), spread=False))
    if "code" not in args.sets:
        return out
    tasks = json.loads(CODE_TASKS.read_text())[:args.code_tasks]
    stubs = render(llm, [[{"role": "user", "content": CODE_INSTRUCTION.format(t["prompt"])}] for t in tasks])
    rounds = [(t, seed) for seed in range(args.code_seeds) for t in range(len(tasks))]
    params = [SamplingParams(temperature=0.2, top_p=0.95, seed=seed, max_tokens=args.max_tokens) for _, seed in rounds]
    batch1 = [i for i, (t, _) in enumerate(rounds) if t < args.code_batch1_tasks]
    out.append(Workload("code", [stubs[t] for t, _ in rounds], params, batch1, spread=True))
    return out


def fastest(repeats: int, *timers: Callable[[], Run]) -> list[Run]:
    """Each timer's fastest of ``repeats`` runs. The timers take turns (A, B, C, A, ...), so a slow spell on the
    shared machine hits them alike instead of skewing one side of a ratio."""
    best: list[Run | None] = [None] * len(timers)
    for _ in range(repeats):
        for i, timer in enumerate(timers):
            run = timer()
            if best[i] is None or run.seconds < best[i].seconds:
                best[i] = run
    return best


def time_eyas(llm: LLM, work: Workload, calls: list[list[int]]) -> Run:
    run = Run(0, 0.0, [])
    for call in calls:
        t0 = time.perf_counter()
        outs = llm.generate([work.prompts[i] for i in call], [work.params[i] for i in call], use_tqdm=False)
        run.seconds += time.perf_counter() - t0
        for o in outs:
            run.ids.append(o.outputs[0].token_ids)
            run.tokens += len(o.outputs[0].token_ids)
            run.spec_steps += o.spec_metrics.get("num_steps", 0)
            run.spec_accepted += o.spec_metrics.get("num_accepted", 0)
    return run


def time_fresh(make: Callable[[], LLM], warmup: list[int], probe: Probe | None, work: Workload,
               calls: list[list[int]]) -> Run:
    """``time_eyas`` on a new engine (an empty global suffix tree), warmed up untimed with a one-token request."""
    gc.collect()
    llm = make()
    llm.generate([warmup], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    if probe is not None:
        probe.attach(llm)
    return time_eyas(llm, work, calls)


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
    print(cpu_line())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}; {cpu_bf16_note()}")

    model_path = resolve_model(args.model)
    shared = {"verification": "shared_noise", "draft_row_cost": args.row_cost}
    ngram_spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                  "prompt_lookup_max": args.lookup_max, **shared}
    common = {"dtype": args.dtype, "num_threads": args.threads, "enable_prefix_caching": False,
              "max_num_seqs": max(64, max(args.batch_sizes)), "matmul_precision": args.matmul_precision}
    plain = LLM(args.model, **common)
    plain_forwards: list[float] = []  # the plain engine's target forwards, collected per measurement
    plain.engine.runner.forward = _timed(plain.engine.runner.forward, plain_forwards)
    ngram = LLM(args.model, speculative_config=ngram_spec, **common)
    make_suffix = partial(LLM, args.model, speculative_config={"method": "suffix", **shared}, **common)
    suffix = make_suffix()  # for the warm-up and the settings line; every timed run gets a fresh one
    eos = list(ModelConfig.from_folder(model_path).eos_token_ids)
    hf_lookup = {"prompt_lookup_num_tokens": args.k, "max_matching_ngram_size": args.lookup_max}

    sets = workloads(plain, args)
    warmup = render(plain, chat_prompts(args.num_prompts + max(args.batch_sizes))[args.num_prompts:])

    hf = None
    if not args.skip_hf:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()

    s = suffix.engine.config.speculative
    row_cost = ngram.engine.scheduler.drafts.row_cost
    print(f"model {model_path}; eos {eos}; up to {args.max_tokens} new tokens (EOS stops earlier); prefix caching off; "
          f"row cost (in one-row forwards) at 5 / 16 rows {row_cost(5):.2f} / {row_cost(16):.2f}; "
          f"shared-noise verification")
    o = s.options
    print(f"ngram: k={args.k}, n-grams {args.lookup_min}-{args.lookup_max}. suffix: k={s.num_speculative_tokens}, "
          f"tree depth {o.suffix_decoding_max_tree_depth}, factor {o.suffix_decoding_max_spec_factor}, min token prob "
          f"{o.suffix_decoding_min_token_prob}, {o.suffix_decoding_max_cached_requests} cached requests")
    for w in sets:
        sampling = "greedy" if w.params[0].greedy else "temperature 0.2, top_p 0.95, seeds per round"
        print(f"  {w.name}: {len(w.prompts)} requests of {min(map(len, w.prompts))}-{max(map(len, w.prompts))} "
              f"prompt tokens, {sampling}; B=1: {len(w.batch1)} one at a time")

    for b in args.batch_sizes:  # untimed warm-up at every measured shape
        for llm in (plain, ngram, suffix):
            llm.generate(warmup[:b], SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
        if hf is not None:
            time_hf(hf, [warmup[:b]], WARMUP_TOKENS, eos, None)
            if b == 1:
                time_hf(hf, [warmup[:1]], WARMUP_TOKENS, eos, hf_lookup)
    del suffix

    head = (f"{'set':<5} {'B':>3} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} {'acc len':>7} "
            f"{'suffix tok/s':>12} {'speedup':>7} {'acc len':>7} {'suffix/ngram':>12} {'identical':>11}")
    print("\n" + head)
    differ = []  # (set, B, engine) where speculation changed an output
    probes: dict[tuple[str, int], Probe] = {}
    for w in sets:
        for b in args.batch_sizes:
            calls = w.calls(b)
            probe = probes[(w.name, b)] = Probe()
            plain_forwards.clear()
            base, fast, suf = fastest(args.repeats, partial(time_eyas, plain, w, calls),
                                      partial(time_eyas, ngram, w, calls),
                                      partial(time_fresh, make_suffix, warmup[0], probe, w, calls))
            probe.plain_forward = list(plain_forwards)
            same = [sum(x == y for x, y in zip(base.ids, run.ids)) for run in (fast, suf)]
            for engine, n in zip(("ngram", "suffix"), same):
                if n < len(base.ids):
                    differ.append(f"{w.name} B={b} {engine}: {n}/{len(base.ids)}")
            print(f"{w.name:<5} {b:>3} {base.tok_s:>11.1f} {fast.tok_s:>11.1f} {fast.tok_s / base.tok_s:>6.2f}x "
                  f"{fast.acceptance_length:>7.2f} {suf.tok_s:>12.1f} {suf.tok_s / base.tok_s:>6.2f}x "
                  f"{suf.acceptance_length:>7.2f} {suf.tok_s / fast.tok_s:>11.2f}x "
                  f"{f'{same[0]}/{len(base.ids)} {same[1]}/{len(base.ids)}':>11}", flush=True)
    print("tok/s = generated tokens (EOS included) / wall time of the generate calls (prefill included); fastest of "
          f"{args.repeats} interleaved runs each;\nspeedup = tok/s over plain; acc len = mean acceptance length "
          "(accepted drafts + 1 per verification step that carried drafts);\nidentical = ngram and suffix outputs "
          "equal to plain, token for token (must be all)")
    print("suffix structure, time per step (all timed runs):")
    for (name, b), probe in probes.items():
        if b == max(args.batch_sizes):
            print(probe.line(name, b))

    if hf is not None:
        print(f"\nHF transformers, greedy: plain vs prompt_lookup_num_tokens={args.k}, max_matching_ngram_size="
              f"{args.lookup_max} (HF tries n-grams {args.lookup_max} down to 1; batch 1 only)")
        print(f"{'set':<5} {'B':>3} {'HF tok/s':>9} {'lookup tok/s':>12} {'speedup':>8}")
        for w in sets:
            if w.name == "code":  # sampled: HF's outputs would not be comparable
                continue
            for b in args.batch_sizes:
                prompts = w.prompts[:args.hf_batch1_prompts] if b == 1 else w.prompts[:b]
                hf_calls = [[p] for p in prompts] if b == 1 else [prompts]
                timers = [partial(time_hf, hf, hf_calls, args.max_tokens, eos, None)]
                if b == 1:
                    timers.append(partial(time_hf, hf, hf_calls, args.max_tokens, eos, hf_lookup))
                hf_base, *hf_fast = fastest(args.repeats, *timers)
                cols = f"{hf_fast[0].tok_s:>12.1f} {hf_fast[0].tok_s / hf_base.tok_s:>7.2f}x" if hf_fast else \
                    f"{'n/a':>12} {'n/a':>8}"
                print(f"{w.name:<5} {b:>3} {hf_base.tok_s:>9.1f} {cols}", flush=True)

    print(f"total wall time {time.perf_counter() - start:.0f} s")
    if differ:
        print(f"FAIL: speculative outputs differ from plain ones ({'; '.join(differ)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
