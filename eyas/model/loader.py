"""Build a model from an HF folder: config.json plus safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.model.layers import RotaryEmbedding
from eyas.model.registry import model_class


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in '{folder}'")
    return files


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               aux_layer_ids: tuple[int, ...] = ()) -> torch.nn.Module:
    """Instantiate the architecture and fill every parameter; a missing tensor is an error."""
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, max_positions, aux_layer_ids)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    params = dict(model.named_parameters())
    fused: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for file in safetensors_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                target = model.load_name(hf_name)
                if target is None:
                    continue
                name, shard, count = target
                if name not in params:
                    raise ValueError(f"model: unexpected tensor '{hf_name}' in {file}")
                tensor = f.get_tensor(hf_name)
                if shard is None:
                    _copy(params[name], tensor, hf_name, file)
                    loaded.add(name)
                    continue
                fused.setdefault(name, {})[shard] = tensor
                if len(fused[name]) == count:
                    _copy(params[name], torch.cat([fused[name][i] for i in range(count)]), hf_name, file)
                    loaded.add(name)
                    del fused[name]
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"model: {len(missing)} weights missing from '{cfg.path}', e.g. {missing[:3]}")
    return model.to(dtype).eval()


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, file: Path) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"model: tensor '{name}' in {file} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
