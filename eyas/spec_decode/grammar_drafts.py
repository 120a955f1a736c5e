"""Grammar-aware drafting for any proposer: forbidden drafts cut, forced tokens drafted for free.

The runner calls it after every method's ``propose``.
For a request with a grammar (``SamplingParams.structured_output``) it walks the proposer's drafts
under the grammar (``GrammarState.plan_drafts``), after this step's emitted tokens:

* a draft the grammar forbids ends the chain before it costs a verification row;
* where the grammar admits a single token, that token is the draft (it replaces a proposer draft
  that differs, and the proposer's later drafts, which followed the wrong token, are dropped);
* past the proposer's drafts, single-token positions keep extending the chain, up to the lookahead
  (``SpeculativeConfig.lookahead``: at least 16, whatever the proposer's k: a forced draft needs no drafter).

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

import torch

from eyas.core.host_ints import host_ints
from eyas.spec_decode.proposer import ProposerInput, ProposerOutput


def grammar_drafts(inp: ProposerInput, out: ProposerOutput, lookahead: int) -> ProposerOutput:
    """``out`` with the drafts of rows that have a grammar walked under it, up to ``lookahead`` a row (see the
    module docstring)."""
    num_rows, k, device = len(inp.grammars), lookahead, out.draft_token_ids.device
    emitted, num_emitted = inp.emitted.tolist(), inp.num_emitted.tolist()
    proposed, counts = out.draft_token_ids.tolist(), out.num_drafts.tolist()
    plans = {}  # row -> its walked drafts
    for r, grammar in enumerate(inp.grammars):
        if grammar is None:
            continue
        walk = grammar.fork(emitted[r][:num_emitted[r]])
        if walk is None:  # the request ends this step
            counts[r] = 0
            continue
        plans[r] = walk.plan_drafts(proposed[r][:counts[r]], k)
        counts[r] = len(plans[r].tokens)
    if not any(counts):  # no row verifies a draft next step (most steps of free text): no tensors to build
        return ProposerOutput(out.draft_token_ids, out.num_drafts.new_zeros(num_rows))
    drafts = torch.zeros(num_rows, k, dtype=torch.int64)  # [R, k]
    width = min(k, out.draft_token_ids.shape[1])
    drafts[:, :width] = out.draft_token_ids[:, :width].cpu()
    forced = torch.zeros(num_rows, k, dtype=torch.bool)  # [R, k]
    for r, plan in plans.items():
        n = len(plan.tokens)
        drafts[r, :n] = torch.tensor(plan.tokens, dtype=torch.int64)
        forced[r, :n] = torch.tensor(plan.forced)
    probs = out.draft_probs  # [R, k', V]: the proposer's, then one-hot rows for forced drafts past its own
    if probs is not None:
        longest = max([probs.shape[1], *(len(plan.tokens) for plan in plans.values())])
        probs = torch.cat([probs, probs.new_zeros(num_rows, longest - probs.shape[1], probs.shape[2])], dim=1)
        for r, plan in plans.items():
            n = len(plan.tokens)
            if n > plan.num_proposed:  # forced tokens the proposer did not draft: one-hot
                probs[r, plan.num_proposed:n] = 0.0
                probs[r, torch.arange(plan.num_proposed, n), torch.tensor(plan.tokens[plan.num_proposed:])] = 1.0
    return ProposerOutput(drafts.to(device), host_ints(counts).to(device), probs, forced)
