"""Tool calling: tokens/s with and without speculation, call validity, and the share of forced drafts, in one run.

Sixteen tasks (``tool_tasks.py``, 2-4 tools each), rendered and constrained as ``LLM.chat(tools=...)`` does, greedy,
one call per reply (``parallel_tool_calls=False``; ``--parallel`` allows more), for ``tool_choice``
"required" and "auto", at B = 1 (the first ``--batch1-tasks`` tasks one call each, times summed) and at
B = 8 (the tasks in batches of 8). Configurations, one engine each (prefix caching off):

* ``none``: no speculation (the baseline of every ratio);
* ``ngram``: prompt-lookup drafts plus the grammar's forced drafts (the wrapper, keys, punctuation);
* ``eagle3``: the EAGLE-3 drafter eyas ships for the default model, plus forced drafts.

Printed per row: tokens/s (generated tokens / wall time, prefill included), the ratio to ``none``,
mean acceptance length, forced share (forced drafts accepted / all drafts accepted), outputs equal to
``none`` token for token (greedy speculation must change nothing), and validity: for "required", the
share of replies whose call parses and validates against its tool's schema (``jsonschema``), and how
many replies ``--max-tokens`` cut (a call cut short is not returned: the only way a reply lacks a valid
call); for "auto", how many replies made a call, and the share of those calls that validate. Each
measurement is taken ``--repeats`` times, the configurations taking turns, and the fastest run counts
(the machine may be shared).

    python benchmarks/bench_tools.py                                 # 1 thread, B = 1,8
    python benchmarks/bench_tools.py --batch1-tasks 4 --choices required --configs none,ngram   # quick
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch
from bench_common import batch_sizes, cpu_line
from tool_tasks import TASKS

from eyas import LLM, SamplingParams
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import constrain
from eyas.tools.render import render_chat

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
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown or "none" not in args.configs.split(","):
        p.error(f"--configs: {sorted(unknown)} unknown; give 'none' and any of {', '.join(CONFIGS)}")
    return args


def validity(outs, tasks) -> tuple[int, int, int]:
    """(replies with a call, replies whose calls all validate against their tools' schemas, replies cut by
    max_tokens: a call cut short is not returned, so a reply cut inside its only call has none)."""
    made = valid = cut = 0
    for out, (_, tools) in zip(outs, tasks):
        completion = out.outputs[0]
        calls = completion.tool_calls or []
        made += bool(calls)
        cut += completion.finish_reason == "length"
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            valid += bool(calls)
        except (ValueError, jsonschema.ValidationError):
            pass
    return made, valid, cut


def run(llm: LLM, tasks, choice: str, batch: int, parallel: bool, max_tokens: int) -> tuple[list, float]:
    """The tasks in groups of ``batch``, each group one engine run (each request rendered and constrained with
    its own tools, as ``LLM.chat`` does for one set of tools); outputs carry their parsed calls."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs, seconds = [], 0.0
    for start in range(0, len(tasks), batch):
        begin = time.perf_counter()
        prompts, plist = [], []
        for prompt, tools in tasks[start:start + batch]:
            request = ToolRequest.from_openai(tools, choice, parallel, tok.chat_template)
            text = render_chat(tok, [{"role": "user", "content": prompt}], request)
            prompts.append(tok.encode(text, add_special_tokens=False))
            plist.append(constrain(params, request))
        group = llm.generate(prompts, plist, use_tqdm=False)
        for out in group:
            out.outputs[0].tool_calls = parse_reply(out.outputs[0].text, request.syntax).calls
        seconds += time.perf_counter() - begin
        outs += group
    return outs, seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"torch threads {args.threads}", flush=True)
    names = args.configs.split(",")
    engines = {name: LLM(speculative_config=CONFIGS[name], enable_prefix_caching=False, max_num_seqs=8,
                         max_model_len=2048) for name in names}
    print(f"{'choice':>8} {'B':>2} {'config':>7} {'tok/s':>7} {'ratio':>6} {'accept':>6} {'forced':>6} "
          f"{'equal':>6} validity", flush=True)
    for choice in args.choices.split(","):
        for batch in args.batch_sizes:
            tasks = TASKS[:args.batch1_tasks] if batch == 1 else TASKS
            best: dict[str, tuple[float, list, dict]] = {}
            for _ in range(args.repeats):  # the configurations take turns; the fastest run of each counts
                for name in names:
                    before = engines[name].stats()
                    outs, seconds = run(engines[name], tasks, choice, batch, args.parallel, args.max_tokens)
                    after = engines[name].stats()
                    delta = {key: after[key] - before[key] for key in ("num_steps", "num_accepted",
                                                                       "num_forced_accepted")}
                    if name not in best or seconds < best[name][0]:
                        best[name] = (seconds, outs, delta)
            base_seconds, base_outs, _ = best["none"]
            base_tokens = sum(len(o.outputs[0].token_ids) for o in base_outs)
            for name in names:
                seconds, outs, delta = best[name]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                steps, accepted = delta["num_steps"], delta["num_accepted"]
                accept = 1 + accepted / steps if steps else 1.0
                equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base_outs))
                made, valid, cut = validity(outs, tasks)
                shown = (f"{valid}/{len(outs)} replies' calls valid, {cut} cut by max_tokens" if choice != "auto"
                         else f"{made}/{len(outs)} made a call, {valid}/{made} valid, {cut} cut by max_tokens")
                print(f"{choice:>8} {batch:>2} {name:>7} {tokens / seconds:7.1f} "
                      f"{tokens / seconds / (base_tokens / base_seconds):6.2f} {accept:6.2f} "
                      f"{delta['num_forced_accepted'] / max(accepted, 1):6.0%} {equal:>3}/{len(outs):<2} {shown}",
                      flush=True)


if __name__ == "__main__":
    main()
