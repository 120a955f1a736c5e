"""Grammar-aware drafting around any proposer: forbidden drafts cut, forced tokens drafted for free.

``make_proposer`` wraps every method's proposer in ``GrammarDrafts``. For a request with a grammar
(``SamplingParams.structured_output``) the wrapper walks the inner proposer's drafts under the grammar
(``GrammarState.plan_drafts``), after this step's emitted tokens:

* a draft the grammar forbids ends the chain before it costs a verification row;
* where the grammar admits a single token, that token is the draft (it replaces a proposer draft
  that differs, and the proposer's later drafts, which followed the wrong token, are dropped);
* past the proposer's drafts, single-token positions keep extending the chain up to k drafts.

A forced draft is the only token the target may emit at its position, so verification always
accepts it; ``ProposerOutput.forced`` marks them and the acceptance metrics count them apart.
Requests without a grammar, and batches without one, pass through untouched.

Lossless in both verification modes. A proposer's draft distribution q is kept for the drafts it
made; the rejection sampler renormalises q over the tokens the grammar allows at each position
(``GrammarMasks.restrict``), which is the distribution of a draft that survived the cut. A forced
draft gets a one-hot q. Example (k = 3, regex ``(ab|cd)e``): the proposer drafts ``[a, x, e]``
from an empty output: ``a`` is allowed (one of a, c), then only ``b`` is: ``x`` is replaced by
``b`` and ``e`` is dropped; then only ``e``: drafts ``[a, b, e]``, forced ``[F, T, T]``.
"""

from __future__ import annotations

import time

import torch

from eyas.spec.proposer import Proposer, ProposerInput, ProposerOutput


class GrammarDrafts(Proposer):
    def __init__(self, inner: Proposer, k: int):
        self.inner = inner
        self.k = k
        self.method = inner.method
        self.needs_hidden_states = inner.needs_hidden_states
        self.aux_layer_ids = inner.aux_layer_ids
        self.seconds = 0.0  # spent walking drafts under grammars

    def kv_cache_groups(self) -> list:
        return self.inner.kv_cache_groups()

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        self.inner.bind_kv_caches(num_blocks, block_size, first_group)

    def request_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                         block_tables: list[list[int]]) -> str | None:
        return self.inner.request_finished(request_id, token_ids, num_prompt_tokens, block_tables)

    def flush(self) -> None:
        self.inner.flush()

    def propose(self, inp: ProposerInput) -> ProposerOutput:
        out = self.inner.propose(inp)
        rows = [r for r, grammar in enumerate(inp.grammars) if grammar is not None]
        if not rows:
            return out
        start = time.perf_counter()
        num_rows, device = len(inp.grammars), out.draft_token_ids.device
        emitted, num_emitted = inp.emitted.tolist(), inp.num_emitted.tolist()
        proposed, counts = out.draft_token_ids.tolist(), out.num_drafts.tolist()
        drafts = torch.zeros(num_rows, self.k, dtype=torch.int64)  # [R, k]
        drafts[:, :out.draft_token_ids.shape[1]] = out.draft_token_ids.cpu()
        forced = torch.zeros(num_rows, self.k, dtype=torch.bool)  # [R, k]
        probs = out.draft_probs.clone() if out.draft_probs is not None else None  # [R, k, V]
        for r in rows:
            plan = inp.grammars[r].plan_drafts(emitted[r][:num_emitted[r]], proposed[r][:counts[r]], self.k)
            n = len(plan.tokens)
            drafts[r, :n] = torch.tensor(plan.tokens, dtype=torch.int64)
            forced[r, :n] = torch.tensor(plan.forced)
            counts[r] = n
            if probs is not None and n > plan.num_proposed:  # forced tokens the proposer did not draft
                probs[r, plan.num_proposed:n] = 0.0
                probs[r, torch.arange(plan.num_proposed, n), torch.tensor(plan.tokens[plan.num_proposed:])] = 1.0
        self.seconds += time.perf_counter() - start
        return ProposerOutput(drafts.to(device), torch.tensor(counts, dtype=torch.int64, device=device), probs, forced)
