"""Tensor names and files of the public drafter layouts, shared by the reader and the writer.

eyas fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``; a layout
also renames the layer prefix. Example (SafeAILab EAGLE-3): the eyas parameter
``layer.self_attn.qkv_proj.weight`` is stored as ``midlayer.self_attn.q_proj.weight``,
``midlayer.self_attn.k_proj.weight`` and ``midlayer.self_attn.v_proj.weight``, in that order
along dim 0.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from eyas.model.loader import safetensors_files

LAYOUTS = {"eagle3": "eagle3", "speculators": "eagle3", "eagle": "eagle", "mtp": "mtp"}  # layout -> method
# method -> the layout of its folders whose config.json carries no marker of their own (EAGLE-1's has none): found
# only when the caller names the method
UNMARKED = {"eagle": "eagle"}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def prefix_renames(layout: str, num_layers: int = 0, num_mtp_layers: int = 0) -> list[tuple[str, str]]:
    """(eyas prefix, checkpoint prefix) pairs; names outside them are stored as they are. ``num_layers``: the
    drafter's decoder layers (EAGLE-3: its later layers ``later_layers.i`` are stored as ``layers.{i + 1}``), or for
    MTP the target's."""
    later = [(f"later_layers.{i}.", f"layers.{i + 1}.") for i in range(max(0, num_layers - 1))]
    if layout == "eagle3":
        return [("layer.", "midlayer."), *later]
    if layout == "speculators":
        return [("layer.", "layers.0."), *later]
    if layout == "eagle":
        return [("layer.", "layers.0.")]
    assert layout == "mtp", layout
    return [(f"layers.{i}.", f"model.layers.{num_layers + i}.") for i in range(num_mtp_layers)]


def checkpoint_names(name: str, renames: list[tuple[str, str]]) -> list[str]:
    """The checkpoint tensors that make up the eyas tensor ``name`` (several for a fused one)."""
    for ours, theirs in renames:
        if name.startswith(ours):
            name = theirs + name[len(ours):]
            break
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{part}.") for part in parts]
    return [name]


def split_fused(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Cut a fused eyas tensor into its checkpoint parts (the inverse of concatenating them)."""
    if ".qkv_proj." in name:
        attn = module.get_submodule(name.split(".qkv_proj.")[0])
        return list(tensor.split([attn.q_size, attn.kv_size, attn.kv_size]))
    if ".gate_up_proj." in name:
        return list(tensor.chunk(2))
    return [tensor]


def is_norm_weight(name: str) -> bool:
    """RMSNorm weights, the ones a Gemma-style checkpoint stores as ``w`` for a ``(1 + w)`` scale."""
    return name.endswith("norm.weight")


class TensorFiles:
    """The tensors of a folder: safetensors (single or sharded), or an old ``pytorch_model.bin``."""

    def __init__(self, folder: Path):
        self.where: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        bin_file = folder / "pytorch_model.bin"
        if bin_file.is_file() and not any(folder.glob("*.safetensors")):
            self._bin = torch.load(bin_file, map_location="cpu", weights_only=True)
            self.where = dict.fromkeys(self._bin, bin_file)
            return
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                self.where.update(dict.fromkeys(f.keys(), file))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if self._bin is not None:
            return self._bin[name]
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name)
