"""Measure a drafter folder with the engine: greedy drafting (chain, or parallel) on held-out prompts at each k.

Acceptance is what the engine really accepts (``llm.stats()``), not an estimate from training
agreement. Requests run one at a time (batch 1), so tok/s is the latency a single user sees; the
plain target runs the same prompts first, for the speedup.
"""

from __future__ import annotations

import time

from eyas.llm import LLM
from eyas.sampling.params import SamplingParams


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def acceptance_by_k(model: str | None, drafter: str, method: str, prompts: list[list[int]], ks: list[int], *,
                    max_tokens: int = 128, num_threads: int | None = None, parallel: bool = False) -> dict:
    """{"plain_tok_s", "weights", "rows": [{"k", "mean_acceptance_length", "per_position", "tok_s", "speedup"}]};
    "weights": the target's weight format and matmul precision (acceptance moves a little with them)."""
    base = dict(max_num_seqs=1, num_threads=num_threads, enable_prefix_caching=False)
    plain_llm = LLM(model, **base)
    config = plain_llm.engine.config
    weights = f"{config.quantization or config.dtype} weights, {config.matmul_precision} matmul precision"
    seconds, tokens = _run(plain_llm, prompts, max_tokens)
    del plain_llm
    plain = tokens / seconds
    rows = []
    for k in ks:
        spec = {"method": method, "model": str(drafter), "num_speculative_tokens": k, "adaptive_draft_length": False}
        llm = LLM(model, speculative_config=spec | ({"parallel_drafting": True} if parallel else {}), **base)
        seconds, tokens = _run(llm, prompts, max_tokens)
        stats = llm.stats()
        rows.append({"k": k, "mean_acceptance_length": round(stats["mean_acceptance_length"], 3),
                     "per_position": [round(a, 3) for a in stats["per_position_acceptance"]][:k],
                     "tok_s": round(tokens / seconds, 2), "speedup": round(tokens / seconds / plain, 3)})
    return {"plain_tok_s": round(plain, 2), "weights": weights, "num_prompts": len(prompts), "max_tokens": max_tokens,
            "rows": rows}
