"""Sampling draft tokens so that verification stays lossless, shared by every model-based drafter.

A draft for sequence position ``p`` is drawn with the request's own sampling settings:

* greedy batches take the argmax;
* ``shared_noise`` verification: the Gumbel noise the target will use at ``p`` (stream 0), so a
  draft equals the target's sample whenever the two distributions agree there;
* ``rejection`` verification: the drafter's own noise stream, keeping the draft distribution
  ``q`` for the rejection sampler.

A request with a grammar drafts under it: each draft step masks the drafter's logits by the grammar
position after the emitted tokens and the drafts so far (a forked copy of the request's position),
so drafts never leave the grammar, a single-token position drafts its token, and the drafter feeds
itself valid tokens (``q`` is the masked distribution). This needs each step's drafts on the host
(one device sync per draft step, for batches with a grammar only). Where the drafter gives no
allowed token any probability (an EAGLE-3 draft vocabulary that lacks it), the allowed tokens share
the row uniformly.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from eyas.sampling.grammar import allowed_tokens
from eyas.sampling.row_ops import argmax, gumbel_argmax
from eyas.sampling.sampler import Sampler, SamplingBatch, probabilities
from eyas.spec_decode.proposer import ProposerInput

DRAFT_NOISE_STREAM = 3  # rejection mode: the drafter's own randomness, independent of the target's


class DraftSampler:
    """One per ``propose`` call: ``sample`` each draft step, then ``draft_probs``."""

    def __init__(self, inp: ProposerInput, verification: str, device: torch.device):
        params = inp.sampling_params
        self.verification = verification
        self.seeds = inp.seeds
        self.all_greedy = all(p.greedy for p in params)
        self.batch = None
        if not self.all_greedy:
            batch = SamplingBatch.from_params(params, [0] * len(params), [0] * len(params), device)
            self.batch = dataclasses.replace(batch, seeds=inp.seeds)
        self.sampler = Sampler()
        self._probs: list[torch.Tensor] = []
        emitted, num_emitted = (inp.emitted.tolist(), inp.num_emitted.tolist()) if any(inp.grammars) else ([], [])
        # [R] forked grammar positions (None: no grammar, or the request ends this step)
        self.walks = [g.fork(emitted[r][:num_emitted[r]]) if g is not None else None
                      for r, g in enumerate(inp.grammars)]

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits [R, vocab] float32 of the drafts at sequence positions [R] -> tokens [R] int64."""
        walking = [r for r, w in enumerate(self.walks) if w is not None]
        bitmasks = {r: self.walks[r].bitmask() for r in walking}  # [W] uint32 each
        if self.all_greedy:
            tokens = _masked_argmax(logits, bitmasks)
        else:
            if walking:
                logits = _mask(logits, bitmasks)
            logprobs = self.sampler.processed_logprobs(logits, dataclasses.replace(self.batch, positions=positions))
            stream = 0 if self.verification == "shared_noise" else DRAFT_NOISE_STREAM
            if self.verification == "rejection":
                self._probs.append(probabilities(logprobs))
            tokens = gumbel_argmax(logprobs, self.seeds, positions, stream=stream)
        if walking:
            drafted = tokens.tolist()
            for r in walking:
                walk = self.walks[r]
                if drafted[r] in walk.eos_token_ids:  # the chain ends there; later drafts are cut
                    self.walks[r] = None
                else:
                    walk.advance(drafted[r])
        return tokens

    def draft_probs(self) -> torch.Tensor | None:
        """[R, k, vocab] for rejection sampling, or None (greedy, or shared-noise verification)."""
        return torch.stack(self._probs, dim=1) if self._probs else None


def _mask(logits: torch.Tensor, bitmasks: dict[int, np.ndarray]) -> torch.Tensor:
    """logits [R, V] with the tokens each row's grammar bitmask (``GrammarState.bitmask``; rows without one: none)
    forbids at -inf."""
    rows = list(bitmasks)
    bitmask = torch.from_numpy(np.stack([bitmasks[r] for r in rows]).view(np.int32))  # [G, W]
    allowed = torch.ones_like(logits, dtype=torch.bool)
    allowed[rows] = allowed_tokens(bitmask, logits.shape[-1]).to(logits.device)
    masked = logits.masked_fill(~allowed, -math.inf)
    dead = ~torch.isfinite(masked).any(dim=-1, keepdim=True)  # nothing the drafter likes is allowed
    return torch.where(dead, torch.where(allowed, 0.0, -math.inf), masked)


def _masked_argmax(logits: torch.Tensor, bitmasks: dict[int, np.ndarray]) -> torch.Tensor:
    """``argmax(_mask(logits, bitmasks))`` [R], masking only the rows whose best token the grammar forbids: where
    it allows that token, no token before it ties it, so the masked row's argmax is the same. Masking a row of
    a 49k vocabulary costs about 0.6 ms; testing one bit, nothing."""
    tokens = argmax(logits)
    if not bitmasks:
        return tokens
    best = tokens.tolist()
    off = [r for r, mask in bitmasks.items()
           if best[r] >= 32 * len(mask) or not (int(mask[best[r] >> 5]) >> (best[r] & 31)) & 1]
    if off:
        tokens[off] = argmax(_mask(logits[off], {i: bitmasks[r] for i, r in enumerate(off)}))
    return tokens
