"""Sampling draft tokens so that verification stays lossless, shared by every model-based drafter.

A draft for sequence position ``p`` is drawn with the request's own sampling settings:

* greedy batches take the argmax;
* ``shared_noise`` verification: the Gumbel noise the target will use at ``p`` (stream 0), so a
  draft equals the target's sample whenever the two distributions agree there;
* ``rejection`` verification: the drafter's own noise stream, keeping the draft distribution
  ``q`` for the rejection sampler.
"""

from __future__ import annotations

import dataclasses

import torch

from eyas.sampling.sampler import Sampler, SamplingBatch, gumbel_argmax
from eyas.spec.proposer import ProposerInput

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

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits [R, vocab] float32 of the drafts at sequence positions [R] -> tokens [R] int64."""
        if self.all_greedy:
            return logits.argmax(dim=-1)
        logprobs = self.sampler.processed_logprobs(logits, dataclasses.replace(self.batch, positions=positions))
        stream = 0 if self.verification == "shared_noise" else DRAFT_NOISE_STREAM
        if self.verification == "rejection":
            self._probs.append(logprobs.exp())
        return gumbel_argmax(logprobs, self.seeds, positions, stream=stream)

    def draft_probs(self) -> torch.Tensor | None:
        """[R, k, vocab] for rejection sampling, or None (greedy, or shared-noise verification)."""
        return torch.stack(self._probs, dim=1) if self._probs else None
