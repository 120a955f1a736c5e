"""Write drafters in the public layouts: ``config.json`` plus ``model.safetensors``.

Aux layer ids are written in the vLLM convention and say so (``aux_layer_convention: "vllm"``).
MTP layers go into a separate folder, or, when ``folder`` already holds the target's checkpoint,
next to it as ``mtp.safetensors`` with the MTP keys merged into its ``config.json`` (and its
shard index, if it has one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.config import ModelConfig
from eyas.model.drafters.base import Drafter
from eyas.model.drafters.layout import LAYOUTS, checkpoint_names, is_norm_weight, prefix_renames, split_fused


def save_drafter(drafter: Drafter, folder: str | os.PathLike, layout: str | None = None, *,
                 verifier: str | None = None, verifier_architectures: tuple[str, ...] = (),
                 num_speculative_tokens: int | None = None, gemma_norms: bool = False,
                 dtype: torch.dtype | None = None) -> Path:
    """layout: ``"eagle3"`` (SafeAILab, the default for EAGLE-3) or ``"speculators"``; EAGLE-1 and MTP
    have one layout each. ``verifier``: the speculators config's target. ``num_speculative_tokens``: the
    default k (speculators: its proposal method; other layouts: eyas's top-level key of that name).
    ``gemma_norms``: store MTP RMSNorm weights as ``w`` for a ``(1 + w)`` scale. ``dtype``: the
    floating-point tensors' dtype on disk (default: as they are)."""
    layout = layout or drafter.method
    if LAYOUTS.get(layout) != drafter.method:
        raise ValueError(f"layout: '{layout}' is not a layout of {drafter.method} drafters")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    if layout == "speculators":
        config = _speculators_config(drafter, verifier, verifier_architectures, num_speculative_tokens)
    elif layout == "eagle3":
        config = _llama_config(cfg, num_layers=cfg.num_layers) | {
            "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": drafter.draft_vocab_size,
            "target_hidden_size": drafter.target_hidden_size, "aux_layer_convention": "vllm",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(drafter.aux_layer_ids)}}
        if drafter.parallel_depths:  # vLLM's name for the mask token, and eyas's depth count
            config |= {"ptd_token_id": drafter.mask_token_id, "parallel_drafting_depths": drafter.parallel_depths}
    elif layout == "eagle":
        config = _llama_config(cfg, num_layers=1) | {"bias": drafter.fc.bias is not None}
    else:
        config = _mtp_config(drafter, gemma_norms)
    if num_speculative_tokens is not None and layout != "speculators":
        config["num_speculative_tokens"] = num_speculative_tokens
    renames = prefix_renames(layout, cfg.num_layers, drafter.num_step_layers)
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if gemma_norms and is_norm_weight(name):
            tensor = tensor - 1
        for part_name, part in zip(checkpoint_names(name, renames), split_fused(drafter, name, tensor)):
            part = part.detach().cpu()
            tensors[part_name] = (part.to(dtype) if dtype is not None and part.is_floating_point() else part).contiguous().clone()
    if layout == "mtp" and (folder / "config.json").is_file():
        _merge_into_target(folder, config, tensors)
    else:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _llama_config(cfg: ModelConfig, num_layers: int) -> dict:
    return {"architectures": [cfg.architecture], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.attention_bias,
            "tie_word_embeddings": False}


def _speculators_config(drafter, verifier, verifier_architectures, num_speculative_tokens) -> dict:
    proposal = {"proposal_type": "greedy"}
    if num_speculative_tokens is not None:
        proposal["speculative_tokens"] = num_speculative_tokens
    parallel = {"mask_token_id": drafter.mask_token_id, "parallel_drafting_depths": drafter.parallel_depths} \
        if drafter.parallel_depths else {}
    kind = "peagle" if parallel else "eagle3"  # speculators' name of a parallel EAGLE-3 drafter
    return parallel | {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": kind,
        "transformer_layer_config": _llama_config(drafter.config, num_layers=drafter.config.num_layers),
        "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(drafter.aux_layer_ids), "aux_layer_convention": "vllm",
        "norm_before_residual": False,
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                               "proposal_methods": [proposal],
                               "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}}}


def _mtp_config(drafter, gemma_norms: bool) -> dict:
    windows = [layer.sliding_window for layer in drafter.attention_layers()]
    sliding = {w for w in windows if w is not None}
    if len(sliding) > 1:
        raise ValueError(f"sliding_window: MTP layers with different windows {sorted(sliding)} do not fit the "
                         f"one 'mtp_sliding_window' config field")
    config = _llama_config(drafter.config, drafter.config.num_layers) | {
        "num_nextn_predict_layers": drafter.num_step_layers, "mtp_gemma_norm": gemma_norms,
        "mtp_layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows]}
    config.pop("model_type")  # the target's architecture name says what the block is
    if sliding:
        config["mtp_sliding_window"] = sliding.pop()
    return config


def _merge_into_target(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    target = json.loads((folder / "config.json").read_text())
    if target.get("num_hidden_layers") != config["num_hidden_layers"]:
        raise ValueError(f"folder: the target in {folder} has {target.get('num_hidden_layers')} layers, the MTP "
                         f"drafter was built for {config['num_hidden_layers']}")
    mtp_keys = ("num_nextn_predict_layers", "mtp_gemma_norm", "mtp_layer_types", "mtp_sliding_window")
    target.update({key: config[key] for key in mtp_keys if key in config})
    (folder / "config.json").write_text(json.dumps(target, indent=2))
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2))
