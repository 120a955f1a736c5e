"""Suffix decoding in front of a model drafter: ``speculative_config={"method": "eagle3", ...,
"enable_suffix_decoding": true}`` (ArcticInference's option of the same name, for its own model drafters).

Each step, suffix decoding (``eyas.spec_decode.suffix``: the request's own text and every earlier output) drafts
first, for every sampling request. A request whose suffix draft scores at least k (the model drafter's
``num_speculative_tokens``; the score is the sum of the draft tokens' estimated probabilities, its expected
accepted length if the estimates were right) takes that draft, up to suffix decoding's own longest draft;
the others take the model drafter's k drafts. ArcticInference's rule, with its threshold.

The two kinds of text pay in different places. A trained drafter predicts the next token or two of fresh
prose; suffix decoding predicts long runs that were written before (a passage copied from the prompt, code
repeated across requests) but has nothing to say about fresh prose, so the two add up
(docs/spec-model-free.md has what it measured).

The model drafter is told to skip the requests that take suffix drafts (``ProposerInput.expected_drafts``
0: a hidden-state drafter leaves them out and catches up when it drafts for them again,
``eyas.spec_decode.catch_up``), so it spends nothing on them. Both keep their state as they would alone: suffix
decoding appends every committed token to its trees, the drafter's caches follow the verification layout.
The engine's lookahead grows to ``SpeculativeConfig.max_drafts`` (the longer of k and suffix decoding's
longest draft, ``SuffixHybridOptions.max_drafts``), and its cost model (``eyas.spec_decode.adaptive``) decides, as for
any proposer, how many drafts are verified.

Example (k = 1): request A's last tokens were seen before, and suffix decoding offers [5, 9, 2] with
probabilities [1.0, 1.0, 0.5] (score 2.5 >= 1): A takes [5, 9, 2], and the drafter skips A. Request B's
suffix draft [7] has probability 0.4 (score 0.4 < 1): B takes the drafter's one draft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from eyas.core.step import DoneRequest
from eyas.spec_decode.adaptive import DraftCost, RowCost
from eyas.spec_decode.config import SpeculativeConfig
from eyas.spec_decode.options import option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput
from eyas.spec_decode.suffix import SuffixOptions, SuffixProposer


@dataclass(frozen=True)
class SuffixHybridOptions(SuffixOptions):
    """The switch, and suffix decoding's own options (which a model drafter's method reads only with it on)."""

    enable_suffix_decoding: bool = option(
        False, "eagle, eagle3, mtp: suffix decoding in front of the drafter; a request whose suffix draft scores at "
               "least k takes it (the --suffix-* options apply)", flag="--spec-suffix")

    def max_drafts(self, k: int) -> int:
        """A request's lookahead slots: the longer of the drafter's k and suffix decoding's longest draft."""
        return max(k, self.longest_draft())


class SuffixHybrid(Proposer):
    """``suffix`` drafts where they score at least k, the model ``drafter``'s elsewhere (module docstring)."""

    switch = "enable_suffix_decoding"
    wraps = frozenset({"eagle", "eagle3", "mtp"})  # drafters that skip the rows they are told 0
    Options = SuffixHybridOptions

    @classmethod
    def wrap(cls, drafter: Proposer, options: SuffixHybridOptions, spec, engine_config, target) -> SuffixHybrid:
        suffix_options = SuffixOptions(**{key: getattr(options, key) for key in SuffixOptions.keys()})
        suffix_spec = SpeculativeConfig("suffix", suffix_options.longest_draft(), options=suffix_options)
        return cls(drafter, SuffixProposer(suffix_spec, engine_config, target), spec.num_speculative_tokens)

    def __init__(self, drafter: Proposer, suffix: SuffixProposer, k: int):
        self.drafter, self.suffix, self.min_score = drafter, suffix, float(k)
        self.method = drafter.method
        self.needs_hidden_states = drafter.needs_hidden_states
        self.aux_layer_ids = drafter.aux_layer_ids
        self.suffix_rows = self.drafter_rows = 0  # rows that took each kind of draft, over the engine's life

    def step_cost(self, device_type: str, products: Callable[[torch.nn.Module], RowCost]) -> DraftCost:
        return self.drafter.step_cost(device_type, products)

    def kv_cache_groups(self) -> list:
        return self.drafter.kv_cache_groups()

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        self.drafter.bind_kv_caches(num_blocks, block_size, first_group)

    def propose(self, inp: ProposerInput) -> ProposerOutput:
        suffix, scores = self.suffix.propose_scored(inp)
        counts = suffix.num_drafts.tolist()  # [R]
        take = [n > 0 and score >= self.min_score for n, score in zip(counts, scores)]  # [R] suffix draft taken
        expected = [0 if t else e for t, e in zip(take, inp.expected_drafts)]
        model = self.drafter.propose(dataclasses.replace(inp, expected_drafts=expected))
        self.suffix_rows += sum(take)
        self.drafter_rows += sum(e > 0 for e in expected)
        if not any(take):
            return model
        rows = torch.tensor(take, device=model.num_drafts.device)  # [R] bool
        width = max(inp.num_speculative_tokens, model.draft_token_ids.shape[1])
        tokens = torch.zeros(len(take), width, dtype=torch.int64, device=rows.device)  # [R, K]
        tokens[:, :model.draft_token_ids.shape[1]] = model.draft_token_ids
        tokens[rows, :suffix.draft_token_ids.shape[1]] = suffix.draft_token_ids[rows]
        return ProposerOutput(tokens, torch.where(rows, suffix.num_drafts, model.num_drafts),
                              _probabilities(model.draft_probs, tokens, take, counts))

    def request_done(self, done: DoneRequest) -> str | None:
        self.suffix.request_done(done)
        return self.drafter.request_done(done)

    def flush(self) -> None:
        self.drafter.flush()

    def close(self) -> None:
        self.suffix.close()
        self.drafter.close()


def _probabilities(model: torch.Tensor | None, tokens: torch.Tensor, take: list[bool],
                   counts: list[int]) -> torch.Tensor | None:
    """Draft probabilities [R, W, V] for rejection sampling when the drafter gave some (sampled drafts): its own
    rows, and one-hot rows for the suffix drafts (which carry none); None when it gave none (all one-hot)."""
    if model is None:
        return None
    width = max([model.shape[1]] + [n for t, n in zip(take, counts) if t])
    probs = model.new_zeros(model.shape[0], width, model.shape[2])  # [R, W, V]
    probs[:, :model.shape[1]] = model
    for r, (t, n) in enumerate(zip(take, counts)):
        if t:
            probs[r] = 0.0
            probs[r, torch.arange(n), tokens[r, :n]] = 1.0
    return probs
