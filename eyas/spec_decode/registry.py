"""Proposers by name, and the wrappers that go in front of them: one line each, imported on first use.

A new drafting method is a file with a ``Proposer`` subclass (and its ``Options``) plus one line in ``PROPOSERS``:
``SpeculativeConfig`` then routes its keys, and the ``eyas`` command offers its flags and its name
(docs/new-proposer.md walks through one).

A wrapper is a proposer that takes another's place when its switch key is true (``"enable_suffix_decoding":
true`` puts suffix decoding in front of a model drafter). Its class declares ``switch``, the methods it ``wraps``,
its ``Options`` (the switch among them) and ``wrap(proposer, options, spec, engine_config, target)``.
"""

from __future__ import annotations

import importlib
from dataclasses import Field, fields

PROPOSERS = {
    "ngram": ("eyas.spec_decode.ngram", "NgramProposer"),
    "suffix": ("eyas.spec_decode.suffix", "SuffixProposer"),
    "draft_model": ("eyas.spec_decode.draft_model", "DraftModelProposer"),
    "eagle": ("eyas.spec_decode.speculator", "EagleSpeculator"),
    "eagle3": ("eyas.spec_decode.speculator", "Eagle3Speculator"),
    "mtp": ("eyas.spec_decode.speculator", "MtpSpeculator"),
    "extract_hidden_states": ("eyas.spec_decode.extract_hidden_states", "ExtractHiddenStatesProposer"),
}
WRAPPERS = {
    "suffix_hybrid": ("eyas.spec_decode.suffix_hybrid", "SuffixHybrid"),
}


def proposer_methods() -> list[str]:
    return sorted(PROPOSERS)


def proposer_class(method: str) -> type:
    if method not in PROPOSERS:
        raise ValueError(f"speculative_config.method: '{method}' is not one of {', '.join(proposer_methods())}")
    module, cls = PROPOSERS[method]
    return getattr(importlib.import_module(module), cls)


def wrapper_class(name: str) -> type:
    module, cls = WRAPPERS[name]
    return getattr(importlib.import_module(module), cls)


def make_proposer(spec, engine_config, target):
    """The proposer of a SpeculativeConfig: its method's, inside the wrappers it switches on."""
    proposer = proposer_class(spec.method)(spec, engine_config, target)
    for name, options in spec.wrappers:
        proposer = wrapper_class(name).wrap(proposer, options, spec, engine_config, target)
    return proposer


def option_fields() -> dict[str, Field]:
    """Every method's and wrapper's option fields by key, in registry order; a key two of them read (``model``)
    is one option."""
    found: dict[str, Field] = {}
    for options in [proposer_class(m).Options for m in PROPOSERS] + [wrapper_class(w).Options for w in WRAPPERS]:
        for f in fields(options):
            found.setdefault(f.name, f)
    return found
