"""Exact replay of n-gram and suffix drafting at batch 1 on bench_spec's workloads: tokens per forward, no timing.

Greedy and shared-noise outputs do not depend on drafting, so once the plain engine has generated each request
(``bench_spec.py``'s chat, copy and code requests at B = 1, in its order), every speculative run of it can be
replayed exactly without the target: each step the real proposer (eyas's ``NgramProposer`` or
``SuffixProposer``, its global tree filled by the earlier requests' outputs) drafts from the committed tokens, the
scheduler's rule (the request's ``DraftBudget`` and ``allocate_drafts``) picks how many drafts to verify, the
accepted ones are the drafts' common prefix with the real continuation, and the step costs the engine's row-cost
curve measured for its weights on this CPU (``eyas/runner/row_cost.py``) at 1 + drafts rows. A request's
prefill and first token are left out on both sides. Printed per workload and proposer:

* ``adaptive``: tokens per forward (one-row forwards, so plain decoding is 1.00) with eyas's default policy;
* ``every``: with every draft verified;
* ``oracle``: verifying, at each step, the number of drafts that maximises tokens per cost among those that
  will be accepted: no policy can do better with these drafts on this curve;
* ``acc len``: tokens per step that verified drafts, adaptive.

Proposer time is not counted (suffix decoding spends about 0.2 ms a step at B = 1, against a 15-20 ms
forward). Use it to compare drafting policies on a host too noisy to time them; ``bench_spec.py`` times them.

    python benchmarks/replay_drafting.py                        # the default model in its GGUF formats, 1 thread
    python benchmarks/replay_drafting.py --code-batch1-tasks 20 # every code task
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import workloads  # noqa: E402

from eyas import LLM  # noqa: E402
from eyas.core.step import DoneRequest  # noqa: E402
from eyas.spec_decode.adaptive import DraftBudget, RowCost, allocate_drafts  # noqa: E402
from eyas.spec_decode.config import SpeculativeConfig  # noqa: E402
from eyas.spec_decode.proposer import ProposerInput  # noqa: E402
from eyas.spec_decode.registry import proposer_class  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2-135M)")
    p.add_argument("--quantization", default="auto", help="the target's weight format, as LLM(quantization=...)")
    p.add_argument("--matmul-precision", default="auto", choices=["auto", "highest", "medium", "low"],
                   help="the target's products: the outputs replayed and the row-cost curve")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=8, help="ngram num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--batch1-prompts", type=int, default=4, help="chat and copy prompts, one at a time")
    p.add_argument("--code-tasks", type=int, default=20)
    p.add_argument("--code-seeds", type=int, default=4)
    p.add_argument("--code-batch1-tasks", type=int, default=5, help="every round of this many code tasks")
    args = p.parse_args(argv)
    args.sets = ["chat", "copy", "code"]  # bench_spec.workloads: all three
    args.num_prompts = args.batch1_prompts
    args.code_batch1_tasks = min(args.code_batch1_tasks, args.code_tasks)
    return args


@dataclass
class Replay:
    """One replayed run: output tokens after the first, their cost in one-row forwards, and the steps that
    verified drafts with the tokens those steps emitted."""

    tokens: int = 0
    cost: float = 0.0
    spec_steps: int = 0
    spec_tokens: int = 0

    @property
    def per_forward(self) -> float:
        return self.tokens / self.cost if self.cost else 1.0

    @property
    def acceptance_length(self) -> float:
        return self.spec_tokens / self.spec_steps if self.spec_steps else 1.0


def accepted_prefix(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
        n += 1
    return n


def replay(proposer, requests: list[tuple[list[int], list[int], object]], k: int, cost: RowCost,
           policy: str) -> Replay:
    """Run ``requests`` (prompt, plain output, params) one after another through ``proposer`` and ``policy``."""
    out = Replay()
    for n, (prompt, output, params) in enumerate(requests):
        request_id, budget = f"r{n}", DraftBudget.start(k)
        history, emitted = list(prompt), output[:1]  # the first token comes from the prefill
        while len(history) - len(prompt) + len(emitted) < len(output):
            inp = ProposerInput(
                request_ids=[request_id], token_ids=[history], emitted=torch.tensor([emitted]),
                num_emitted=torch.tensor([len(emitted)]), num_speculative_tokens=k, input_ids=torch.empty(0),
                positions=torch.empty(0), query_start_loc=torch.empty(0), seq_lens=torch.empty(0), sample_rows=[0],
                hidden_states=None, aux_hidden_states=None, block_tables=[], next_token_ids=[-1], num_drafts=[0],
                expected_drafts=[k], seeds=torch.zeros(1, dtype=torch.int64), sampling_params=[params])
            drafted = proposer.propose(inp)
            history = history + emitted
            done = len(history) - len(prompt)
            room = len(output) - done - 1  # max_tokens leaves room for this many drafts
            drafts = drafted.draft_token_ids[0, :int(drafted.num_drafts[0])].tolist()[:max(0, room)]
            truth = output[done:]
            right = accepted_prefix(drafts, truth)
            if policy == "every":
                verify = len(drafts)
            elif policy == "oracle":
                verify = max(range(right + 1), key=lambda v: (v + 1) / cost(1 + v))
            else:
                usable = min(len(drafts), budget.limit)
                verify = allocate_drafts([(usable, budget.acceptance(), 0)], 1, cost, len(drafts))[0]
            accepted = min(verify, right)
            budget.update(verify, accepted)
            out.cost += cost(1 + verify)
            if verify:
                out.spec_steps += 1
                out.spec_tokens += accepted + 1
            emitted = truth[:accepted + 1]
        out.tokens += len(output) - 1
        proposer.request_done(DoneRequest(request_id, prompt + output, len(prompt), None))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = LLM(args.model, quantization=args.quantization, num_threads=args.threads, enable_prefix_caching=False,
              matmul_precision=args.matmul_precision)
    config = llm.engine.config
    methods = {"ngram": {"num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                         "prompt_lookup_max": args.lookup_max},
               "suffix": {}}
    cost = SpeculativeConfig.from_dict({"method": "ngram"} | methods["ngram"]).row_cost(
        config.device.type, llm.engine.runner.measured_row_cost)
    print(f"row costs ({config.quantization or config.dtype} weights on {config.device.type}): "
          + ", ".join(f"{n}: {cost(n):.2f}" for n in (1, 2, 3, 4, 5, 8, 12, 16)))
    print(f"{'set':<6}{'proposer':<9}{'adaptive':>9}{'every':>8}{'oracle':>8}{'acc len':>9}   tokens per forward")
    for w in workloads(llm, args):
        requests = []
        for i in w.batch1:  # one at a time, in bench_spec's order
            result = llm.generate([w.prompts[i]], w.params[i], use_tqdm=False)[0]
            requests.append((w.prompts[i], list(result.outputs[0].token_ids), w.params[i]))
        for method, options in methods.items():
            spec = SpeculativeConfig.from_dict({"method": method} | options)
            runs = {policy: replay(proposer_class(method)(spec, config, None), requests, spec.num_speculative_tokens,
                                   cost, policy) for policy in ("adaptive", "every", "oracle")}
            print(f"{w.name:<6}{method:<9}{runs['adaptive'].per_forward:>9.3f}{runs['every'].per_forward:>8.3f}"
                  f"{runs['oracle'].per_forward:>8.3f}{runs['adaptive'].acceptance_length:>9.2f}")
    llm.close()


if __name__ == "__main__":
    main()
