"""Helpers shared by tests that drive the engine step by step."""

from __future__ import annotations

import torch


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


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights in place (norm weights near 1), so a random drafter gives varied tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.08 if p.dim() == 2 else 0.05))
    return module
