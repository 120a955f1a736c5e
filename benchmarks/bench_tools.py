"""Tool calling: tokens/s with and without speculation, call validity, and the share of forced drafts, in one run.

Sixteen tasks (``tool_tasks.py``, 2-4 tools each), rendered and constrained as ``LLM.chat(tools=...)`` does, greedy,
one call per reply (``parallel_tool_calls=False``; ``--parallel`` allows more), for ``tool_choice``
"required" and "auto", at B = 1 (the first ``--batch1-tasks`` tasks one call each, times summed) and at
B = 8 (the tasks in batches of 8). Configurations, one engine each (prefix caching off):

* ``none``: no speculation (the baseline of every ratio);
* ``ngram``: prompt-lookup drafts plus the grammar's forced drafts (the wrapper, keys, punctuation);
* ``eagle3``: the EAGLE-3 drafter eyas ships for the default model, plus forced drafts.

Printed per row: tokens/s (generated tokens / wall time, prefill included), the ratio to ``none``, at B = 1 the same
ratio over the decode alone ("decode x": the tokens after each reply's first over the time from its first token to
its last, so the prompt's prefill is left out), mean acceptance length, forced share (forced drafts accepted / all
drafts accepted), outputs equal to ``none`` token for token (greedy speculation must change nothing), and validity:
for "required", the share of replies whose call parses and validates against its tool's schema (``jsonschema``), and
how many replies ``--max-tokens`` cut (a call cut short is not returned: the only way a reply lacks a valid call);
for "auto", how many replies made a call, and the share of those calls that validate. Each group of
tasks (one task at B = 1, eight at B = 8) is run ``--repeats`` times, the configurations taking turns on it, and
each configuration's fastest run of each group counts (the host's speed drifts between runs; turns of one group
share the drift).

vLLM (``/opt/vllm-cpu-venv``, ``peer_vllm.py``), when installed, runs the same token ids under the same
grammar (its ``guidance`` structured-output backend reads llguidance's Lark grammars; the calls are Hermes's,
the syntax of vLLM's ``hermes`` tool parser) without speculation and with n-gram drafts (k 8), one launch
per choice and method; its replies are parsed and validated as eyas's. peer_vllm.py's B = 8 runs the first
8 tasks in one call (eyas's, all 16 in two). ``--skip-vllm`` leaves it out (each launch starts vLLM anew:
minutes on a small machine).

    python benchmarks/bench_tools.py                                 # 1 thread, B = 1,8
    python benchmarks/bench_tools.py --batch1-tasks 4 --choices required --configs none,ngram --skip-vllm  # quick
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jsonschema
import torch
from bench_common import VLLM_VENV, batch_sizes, cpu_line, run_vllm_peer
from tool_tasks import TASKS

from eyas import LLM, SamplingParams
from eyas.model.resolve import resolve_model
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import constrain, tool_grammar
from eyas.tools.render import render_chat

# the configurations vLLM runs here (the shipped EAGLE-3 folder in vLLM: bench_drafters.py --vllm)
VLLM_CONFIGS = ("none", "ngram")
CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "eagle3": {"method": "eagle3"},  # the shipped drafter at its own k
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8")
    p.add_argument("--batch1-tasks", type=int, default=8, help="tasks run one at a time for B = 1")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--choices", default="required,auto")
    p.add_argument("--configs", default="none,ngram,eagle3", help=f"comma-separated of {', '.join(CONFIGS)}")
    p.add_argument("--parallel", action="store_true", help="parallel_tool_calls=True")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement, taking turns; the fastest counts")
    p.add_argument("--skip-vllm", action="store_true", help="leave vLLM out")
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown or "none" not in args.configs.split(","):
        p.error(f"--configs: {sorted(unknown)} unknown; give 'none' and any of {', '.join(CONFIGS)}")
    return args


def validity(replies: list[tuple[list, str]], tasks) -> tuple[int, int, int]:
    """(replies with a call, replies whose calls all validate against their tools' schemas, replies cut by
    max_tokens). ``replies``: (the reply's parsed calls, its finish reason) per task."""
    made = valid = cut = 0
    for (calls, finish), (_, tools) in zip(replies, tasks):
        made += bool(calls)
        cut += finish == "length"
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            valid += bool(calls)
        except (ValueError, jsonschema.ValidationError):
            pass
    return made, valid, cut


def decode_rate(outs) -> float:
    """Tokens after each reply's first over the time from its first token to its last (replies run one at a time)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / sum(o.metrics.finish_time - o.metrics.first_token_time for o in outs)


def shown(choice: str, replies: list[tuple[list, str]], tasks) -> str:
    made, valid, cut = validity(replies, tasks)
    if choice == "auto":
        return f"{made}/{len(replies)} made a call, {valid}/{made} valid, {cut} cut by max_tokens"
    return f"{valid}/{len(replies)} replies' calls valid, {cut} cut by max_tokens"


def requests(tok, tasks, choice: str, parallel: bool) -> list[tuple[list[int], ToolRequest]]:
    """Each task's prompt token ids and tool request, as ``LLM.chat`` renders and constrains them."""
    out = []
    for prompt, tools in tasks:
        request = ToolRequest.from_openai(tools, choice, parallel, tok)
        text = render_chat(tok, [{"role": "user", "content": prompt}], request)
        out.append((tok.encode(text, add_special_tokens=False), request))
    return out


def run(llm: LLM, tasks, choice: str, batch: int, parallel: bool, max_tokens: int) -> tuple[list, float]:
    """The tasks in groups of ``batch``, each group one engine run (each request rendered and constrained with
    its own tools, as ``LLM.chat`` does for one set of tools); outputs carry their parsed calls."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs, seconds = [], 0.0
    for start in range(0, len(tasks), batch):
        begin = time.perf_counter()
        group = requests(llm.get_tokenizer(), tasks[start:start + batch], choice, parallel)
        results = llm.generate([ids for ids, _ in group], [constrain(params, r) for _, r in group], use_tqdm=False)
        for out, (_, request) in zip(results, group):
            out.outputs[0].tool_calls = parse_reply(out.outputs[0].text, request.syntax).calls
        seconds += time.perf_counter() - begin
        outs += results
    return outs, seconds


def run_vllm(args, tok, choice: str, method: str) -> list[dict]:
    """peer_vllm.py in vLLM's venv over every task (same token ids, same grammars): one record per batch size."""
    group = requests(tok, TASKS, choice, args.parallel)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps([ids for ids, _ in group]))
        (Path(tmp) / "structured.json").write_text(json.dumps([{"grammar": tool_grammar(r)} for _, r in group]))
        return run_vllm_peer(["--model", str(resolve_model(None)), "--prompts", f"{tmp}/prompts.json", "--structured",
                              f"{tmp}/structured.json", "--structured-backend", "guidance", "--max-tokens",
                              str(args.max_tokens), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                              "--batch1-prompts", str(args.batch1_tasks), "--dtype", "float32", "--cpu-bind",
                              f"0-{args.threads - 1}" if args.threads > 1 else "0", "--spec-method", method,
                              "--k", "8", "--prompt-lookup-min", "2"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"torch threads {args.threads}", flush=True)
    names = args.configs.split(",")
    engines = {name: LLM(speculative_config=CONFIGS[name], enable_prefix_caching=False, max_num_seqs=8,
                         max_model_len=2048) for name in names}
    print(f"{'choice':>8} {'B':>2} {'config':>7} {'tok/s':>7} {'ratio':>6} {'decode x':>8} {'accept':>6} "
          f"{'forced':>6} {'equal':>6} validity", flush=True)
    rates: dict[tuple[str, int, str], float] = {}  # (choice, B, config) -> eyas's tok/s
    for choice in args.choices.split(","):
        for batch in args.batch_sizes:
            tasks = TASKS[:args.batch1_tasks] if batch == 1 else TASKS
            # per group of ``batch`` tasks, the configurations take turns, and each one's fastest run of the group
            # counts: the host's speed drifts between runs, and turns this short share the drift
            groups: dict[tuple[str, int], tuple[float, list, dict]] = {}
            for _ in range(args.repeats):
                for g in range(0, len(tasks), batch):
                    for name in names:
                        before = engines[name].stats()
                        outs, seconds = run(engines[name], tasks[g:g + batch], choice, batch, args.parallel,
                                            args.max_tokens)
                        after = engines[name].stats()
                        delta = {key: after[key] - before[key] for key in ("num_steps", "num_accepted",
                                                                           "num_forced_accepted")}
                        if (name, g) not in groups or seconds < groups[name, g][0]:
                            groups[name, g] = (seconds, outs, delta)
            best: dict[str, tuple[float, list, dict]] = {}
            for name in names:
                runs = [groups[name, g] for g in range(0, len(tasks), batch)]
                best[name] = (sum(r[0] for r in runs), [o for r in runs for o in r[1]],
                              {key: sum(r[2][key] for r in runs) for key in runs[0][2]})
            base_seconds, base_outs, _ = best["none"]
            base_tokens = sum(len(o.outputs[0].token_ids) for o in base_outs)
            for name in names:
                seconds, outs, delta = best[name]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                steps, accepted = delta["num_steps"], delta["num_accepted"]
                accept = 1 + accepted / steps if steps else 1.0
                equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base_outs))
                replies = [(o.outputs[0].tool_calls, o.outputs[0].finish_reason) for o in outs]
                decode = f"{decode_rate(outs) / decode_rate(base_outs):8.2f}" if batch == 1 else f"{'-':>8}"
                print(f"{choice:>8} {batch:>2} {name:>7} {tokens / seconds:7.1f} "
                      f"{tokens / seconds / (base_tokens / base_seconds):6.2f} {decode} {accept:6.2f} "
                      f"{delta['num_forced_accepted'] / max(accepted, 1):6.0%} {equal:>3}/{len(outs):<2} "
                      f"{shown(choice, replies, tasks)}", flush=True)
                rates[(choice, batch, name)] = tokens / seconds
    if args.skip_vllm or not (VLLM_VENV / "bin" / "python").exists():
        print("vLLM: skipped" + ("" if args.skip_vllm else f" (no venv at {VLLM_VENV}; benchmarks/setup_vllm_cpu.sh)"))
        return
    tok = engines["none"].get_tokenizer()
    print(f"vLLM-cpu, same token ids and grammars ({args.threads} core(s)); 'x eyas': vLLM's tok/s over eyas's "
          f"same configuration", flush=True)
    for choice in args.choices.split(","):
        for method in VLLM_CONFIGS:
            for record in run_vllm(args, tok, choice, method):
                batch, ids = record["batch_size"], record["token_ids"]
                tasks = TASKS[:len(ids)]
                syntaxes = [r.syntax for _, r in requests(tok, tasks, choice, args.parallel)]
                replies = [(parse_reply(tok.decode(t, keep=s.special_ids), s).calls, f) for t, s, f in
                           zip(ids, syntaxes, record["finish_reasons"])]
                ours = rates.get((choice, batch, method))
                spec = record.get("spec", {})
                print(f"{choice:>8} {batch:>2} {'vllm ' + method:>11} {record['tokens_per_s']:7.1f} "
                      f"{record['tokens_per_s'] / ours if ours else float('nan'):6.2f}x eyas "
                      f"accept {spec.get('mean_acceptance_length', 1.0):.2f} {shown(choice, replies, tasks)}",
                      flush=True)


if __name__ == "__main__":
    main()
