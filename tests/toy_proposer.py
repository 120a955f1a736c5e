"""A whole drafting method in one file, as docs/new-proposer.md shows: it drafts copies of the request's last
token (which pays on runs such as "=====" or "    "), at most ``repeat_max_drafts`` of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.spec_decode.options import MethodOptions, option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput


@dataclass(frozen=True)
class RepeatOptions(MethodOptions):
    repeat_max_drafts: int = option(2, "repeat: copies of the last token to draft", flag="--repeat-max-drafts",
                                    parse=int)

    def validate(self) -> None:
        if self.repeat_max_drafts < 1:
            raise ValueError(f"speculative_config.repeat_max_drafts: {self.repeat_max_drafts} must be >= 1")


class RepeatProposer(Proposer):
    method = "repeat"
    Options = RepeatOptions

    def __init__(self, spec, engine_config, target):
        self.k = min(spec.num_speculative_tokens, spec.options.repeat_max_drafts)

    def propose(self, inp: ProposerInput) -> ProposerOutput:
        rows = torch.arange(len(inp.token_ids))
        last = inp.emitted[rows, inp.num_emitted - 1]  # [R] each request's newest token
        drafts = last[:, None].expand(-1, self.k).contiguous()  # [R, k]
        return ProposerOutput(drafts, torch.full((len(rows),), self.k, dtype=torch.int64))
