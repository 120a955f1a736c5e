"""Helpers shared by tests that drive the engine step by step."""

from __future__ import annotations

import torch

from eyas import SamplingParams
from eyas.spec_decode.proposer import ProposerInput


def run_counting_preemptions(llm, prompts: list[list[int]], params) -> tuple[list, int]:
    """Step ``llm``'s engine until every prompt finished; outputs in prompt order and the preemptions seen."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"req-{i}", p, params)
    requests = list(engine.scheduler.requests.values())
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.flush()
    return [done[f"req-{i}"] for i in range(len(prompts))], sum(r.num_preemptions for r in requests)


def host_input(rows: dict[str, tuple[list[int], list[int]]], k: int, expected: int | None = None,
               params=None) -> ProposerInput:
    """A ProposerInput for proposers that read only committed tokens (n-gram, suffix decoding), without a
    verification layout: request id -> (committed tokens, tokens emitted this step); ``expected``: the drafts
    the scheduler expects to verify per row (default k); ``params``: every row's SamplingParams."""
    ids = list(rows)
    width = max(len(e) for _, e in rows.values())
    return ProposerInput(
        request_ids=ids, token_ids=[rows[i][0] for i in ids],
        emitted=torch.tensor([rows[i][1] + [-1] * (width - len(rows[i][1])) for i in ids]),
        num_emitted=torch.tensor([len(rows[i][1]) for i in ids]), num_speculative_tokens=k,
        input_ids=torch.zeros(0), positions=torch.zeros(0), query_start_loc=torch.zeros(1), seq_lens=torch.zeros(0),
        sample_rows=list(range(len(ids))), hidden_states=None, aux_hidden_states=None, block_tables=[],
        next_token_ids=[], num_drafts=[0] * len(ids), expected_drafts=[k if expected is None else expected] * len(ids),
        seeds=torch.zeros(len(ids), dtype=torch.int64), sampling_params=[params or SamplingParams()] * len(ids))


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights in place (norm weights near 1), so a random drafter gives varied tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.08 if p.dim() == 2 else 0.05))
    return module
