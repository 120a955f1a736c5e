"""Architectures eyas can run, keyed by the HF ``architectures`` name; classes import lazily."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureTraits:
    module: str
    cls: str
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k


_ARCHITECTURES = {
    "LlamaForCausalLM": ArchitectureTraits("eyas.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ArchitectureTraits("eyas.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ArchitectureTraits("eyas.model.llama", "LlamaForCausalLM", attention_bias=True),
    "Qwen3ForCausalLM": ArchitectureTraits("eyas.model.llama", "LlamaForCausalLM", qk_norm=True),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture_traits(name: str, source: object = "") -> ArchitectureTraits:
    if name not in _ARCHITECTURES:
        raise ValueError(
            f"architectures: '{name}' ({source}) is not supported; supported: {', '.join(supported_architectures())}")
    return _ARCHITECTURES[name]


def model_class(name: str):
    traits = architecture_traits(name)
    return getattr(importlib.import_module(traits.module), traits.cls)
