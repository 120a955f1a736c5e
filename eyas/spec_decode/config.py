"""``speculative_config``: which drafter, how many draft tokens, how drafts are verified."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property

import torch

from eyas.config import MAX_SPECULATIVE_TOKENS
from eyas.spec_decode.adaptive import FREE_ROWS, DraftCost, RowCost
from eyas.spec_decode.options import MethodOptions
from eyas.spec_decode.registry import PROPOSERS, WRAPPERS, proposer_class, wrapper_class

VERIFICATION_MODES = ("rejection", "shared_noise")
# drafts a grammar may force in a step, past a drafter's k (SpeculativeConfig.lookahead): as many as any drafter may
# make. Forced drafts are always accepted, and a row costs a fraction of the step it saves, so a run of them is best
# verified whole: bench_tools.py "required", B = 1, one thread, 8 -> 16: n-gram's decode 1.92x -> 2.08x no
# speculation, EAGLE-3's 1.60x -> 1.74x (acceptance lengths 4.45 -> 5.12 and 5.45 -> 7.70); 32: the same as 16.
FORCED_LOOKAHEAD = MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative settings: what every method shares, the method's own ``options`` (its proposer's
    ``Options``, ``eyas.spec_decode.options``) and the ``wrappers`` switched on in front of it. ``from_dict`` takes vLLM's
    flat dict and routes each key to whoever reads it.

    ``verification``: ``"rejection"`` (Leviathan et al.; drafts without probabilities count as one-hot; output
    follows the target distribution) or ``"shared_noise"`` (target and drafter share the seeded Gumbel noise;
    output is token-identical to the same seeded request without speculation). Greedy requests take an
    exact-match fast path under both. Rejection is the default: it is the maximal coupling of draft and target
    (a sampled draft is accepted with probability 1 - TV(p, q), the most any coupling allows; a one-hot draft x
    with p(x) under both modes); docs/speculative-decoding.md has what it measured.
    """

    method: str
    num_speculative_tokens: int
    verification: str = "rejection"
    # shrink drafts when they keep being rejected, and verify in a batch only the drafts
    # worth their rows (spec/adaptive.py); False = always verify every draft
    adaptive_draft_length: bool = True
    # what one more row of a forward costs, as a fraction of a one-row forward (spec/adaptive.py): a forward of
    # n rows costs 1 + c * n, and drafts are verified only while their expected tokens cover their rows.
    # None = this CPU's measured curve for the target's products (eyas/runner/row_cost.py), and 0 on CUDA, where a few more rows
    # cost next to nothing (every draft is verified)
    draft_row_cost: float | None = None
    # what drafting costs in a step in which some request drafts, as a fraction of a one-row forward, for a
    # proposer that leaves out the requests the scheduler expects to verify no drafts of (spec/adaptive.py):
    # drafts are verified only where they pay for it too. None = the proposer's figure for the device
    # (``Proposer.step_cost``: for hidden-state drafters on a CPU 0.11 + 0.18 a pass at one request, growing with
    # the requests as their products measure on this machine; 0 on CUDA and for n-gram and suffix). A number here is
    # flat.
    draft_step_cost: float | None = None
    options: MethodOptions = MethodOptions()  # the method's own keys (its proposer's Options)
    wrappers: tuple[tuple[str, MethodOptions], ...] = ()  # (name, options) of each wrapper switched on, inner first

    @cached_property
    def max_drafts(self) -> int:
        """The most drafts a proposer makes for a request in a step: k, or more where a wrapper drafts longer
        (suffix decoding in front of a drafter: its longest draft, 12 by default)."""
        return max([self.num_speculative_tokens, *(options.max_drafts(self.num_speculative_tokens)
                                                   for _, options in self.wrappers)])

    @cached_property
    def lookahead(self) -> int:
        """The most drafts a request may verify in a step (its lookahead slots): ``max_drafts``, or up to
        ``FORCED_LOOKAHEAD`` where its grammar forces the tokens (``eyas.spec_decode.grammar_drafts``): a forced draft
        costs no drafter pass and is always accepted, so the shipped EAGLE-3 drafter (k = 3) verifies a tool call's
        ``", "arguments": {"`` and the key after it in one step."""
        return max(self.max_drafts, FORCED_LOOKAHEAD)

    def row_cost(self, device_type: str, measured: Callable[[], RowCost]) -> RowCost:
        """``draft_row_cost``'s line, else on a CPU the curve measured for the target (``measured()``, called only
        then: eyas/runner/row_cost.py), else FREE_ROWS."""
        if self.draft_row_cost is not None:
            return RowCost.linear(self.draft_row_cost)
        return measured() if device_type == "cpu" else FREE_ROWS

    def step_cost(self, device_type: str, proposer, products: Callable[[torch.nn.Module], RowCost]) -> DraftCost:
        """``draft_step_cost`` flat, else the proposer's (``Proposer.step_cost``; ``products`` measures on a CPU)."""
        if self.draft_step_cost is not None:
            return DraftCost(base=self.draft_step_cost)
        return proposer.step_cost(device_type, products)

    @classmethod
    def from_dict(cls, config: dict | "SpeculativeConfig") -> "SpeculativeConfig":
        """From vLLM's flat dict: the shared keys, then each other key to the method's options or to the
        options of a wrapper that can go in front of the method."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config: expected a dict, got {type(config).__name__}")
        if "method" not in config:
            raise ValueError("speculative_config.method: missing (e.g. 'ngram' or 'draft_model')")
        method = config["method"]
        proposer = proposer_class(method)  # raises with the list of methods
        shared = {f.name for f in fields(cls)} - {"options", "wrappers"}
        wrappers = {name: wrapper_class(name) for name in WRAPPERS}
        fitting = {name: w for name, w in wrappers.items() if method in w.wraps}
        readers = [proposer.Options, *(w.Options for w in fitting.values())]
        known = shared | set().union(*(o.keys() for o in readers))
        other = _other_keys(wrappers)
        for key in config:
            if key in known:
                continue
            if key in other:
                raise ValueError(f"speculative_config.{key}: not used by method '{method}' (it reads "
                                 f"{', '.join(sorted(known - shared)) or 'none of the method options'})")
            raise ValueError(f"speculative_config: unknown key(s) {[key]}; allowed: {sorted(known)}")
        options = proposer.Options(**{k: v for k, v in config.items() if k in proposer.Options.keys()})
        on = []
        for name, wrapper in fitting.items():
            wrapped = wrapper.Options(**{k: v for k, v in config.items() if k in wrapper.Options.keys()})
            switch = getattr(wrapped, wrapper.switch)
            if switch is True:
                on.append((name, wrapped))
                continue
            if switch is not False:
                raise ValueError(f"speculative_config.{wrapper.switch}: {switch!r} must be true or false")
            for key in wrapped.changed():
                if key not in proposer.Options.keys():
                    raise ValueError(f"speculative_config.{key}: method '{method}' reads it only with "
                                     f"{wrapper.switch}: true")
        common = {k: v for k, v in config.items() if k in shared}
        if "num_speculative_tokens" not in common:
            k = proposer.default_num_speculative_tokens(config)
            if k is None:
                raise ValueError("speculative_config.num_speculative_tokens: missing (e.g. 4)")
            common["num_speculative_tokens"] = k
        return cls(**common, options=options, wrappers=tuple(on))

    def __post_init__(self):
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: {k!r} must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"speculative_config.verification: '{self.verification}' is not one of "
                             f"{', '.join(VERIFICATION_MODES)}")
        for name in ("draft_row_cost", "draft_step_cost"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                meaning = "verify every draft" if name == "draft_row_cost" else "drafting costs nothing"
                raise ValueError(f"speculative_config.{name}: {value!r} must be a number >= 0 (0 = {meaning})")
        self.options.validate()
        for _, options in self.wrappers:
            options.validate()
        proposer_class(self.method).validate_config(self)


def _other_keys(wrappers: dict) -> set[str]:
    """Every key some method or wrapper reads."""
    return set().union(*(proposer_class(m).Options.keys() for m in PROPOSERS),
                       *(w.Options.keys() for w in wrappers.values()))
