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
share of replies whose call parses and validates against its tool's schema (``jsonschema``); for
"auto", how many replies made a call, and the share of those calls that validate.

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
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 4},
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
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown or "none" not in args.configs.split(","):
        p.error(f"--configs: {sorted(unknown)} unknown; give 'none' and any of {', '.join(CONFIGS)}")
    return args


def validity(outs, tasks) -> tuple[int, int]:
    """(replies with a call, calls that validate against their tool's schema)."""
    made = valid = 0
    for out, (_, tools) in zip(outs, tasks):
        calls = out.outputs[0].tool_calls or []
        made += bool(calls)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            valid += bool(calls)
        except (ValueError, jsonschema.ValidationError):
            pass
    return made, valid


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
            request = ToolRequest.from_openai(tools, choice, parallel)
            text = render_chat(tok, [{"role": "user", "content": prompt}], request)
            prompts.append(tok.encode(text, add_special_tokens=False))
            plist.append(constrain(params, request))
        group = llm.generate(prompts, plist, use_tqdm=False)
        for out in group:
            out.outputs[0].tool_calls = parse_reply(out.outputs[0].text).calls
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
            base = None
            for name in names:
                llm = engines[name]
                before = llm.stats()
                outs, seconds = run(llm, tasks, choice, batch, args.parallel, args.max_tokens)
                after = llm.stats()
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                ids = [o.outputs[0].token_ids for o in outs]
                if base is None:
                    base = (tokens / seconds, ids)
                steps = after["num_steps"] - before["num_steps"]
                accepted = after["num_accepted"] - before["num_accepted"]
                forced = after["num_forced_accepted"] - before["num_forced_accepted"]
                accept = 1 + accepted / steps if steps else 1.0
                made, valid = validity(outs, tasks)
                shown = (f"{valid}/{len(outs)} calls valid" if choice != "auto"
                         else f"{made}/{len(outs)} made a call, {valid}/{max(made, 1)} valid")
                print(f"{choice:>8} {batch:>2} {name:>7} {tokens / seconds:7.1f} {tokens / seconds / base[0]:6.2f} "
                      f"{accept:6.2f} {forced / max(accepted, 1):6.0%} {sum(a == b for a, b in zip(ids, base[1])):>3}"
                      f"/{len(ids):<2} {shown}", flush=True)


if __name__ == "__main__":
    main()
