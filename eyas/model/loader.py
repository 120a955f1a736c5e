"""Build a model from an HF folder: config.json plus safetensors (single file or sharded with an index).

``quantization``: None keeps every weight in the engine dtype. ``"gguf"`` keeps the matrices of the
GGUF file the folder was converted from in their own block formats (``QuantLinear``,
``QuantEmbedding``); only the norms and biases come from the folder, and no float copy of a
quantized matrix is ever made. ``"int8"`` replaces every ``Linear`` of the loaded model with
per-output-channel int8 (the embedding stays in the engine dtype). ``"bf16"`` rounds every matrix, the
embedding included, to bfloat16 rows computed by the same kernel with float32 activations (a tied head
shares the embedding's rows); the float32 weights are freed once converted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.model.layers import Linear, RotaryEmbedding
from eyas.model.llama import Attention
from eyas.model.quantized import (
    FORMATS,
    KERNEL_ALIGN,
    Arena,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    quantize_int8,
    quantize_q8_0,
    to_bf16,
)
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


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)``: every parameter and buffer of a module built on the meta device gets
    uninitialised storage on ``device``, without torch's reference ``empty_like``, whose first call on a meta
    tensor imports sympy (about 0.3 s of start-up)."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               aux_layer_ids: tuple[int, ...] = (), quantization: str | None = None,
               matmul_precision: str = "highest") -> torch.nn.Module:
    """Instantiate the architecture and fill every parameter; a missing tensor is an error. ``matmul_precision``:
    the products of the quantized weights (``eyas.model.quantized.MATMUL_PRECISIONS``)."""
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, max_positions, aux_layer_ids)
    quantized = _install_gguf_weights(model, cfg, dtype) if quantization == "gguf" else set()
    materialize(model, device)
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
                if name in quantized:
                    continue
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
    model = model.to(dtype).eval()
    if quantization == "int8":
        linears_to_int8(model)
    elif quantization == "bf16":
        _install_bf16(model, dtype)
    if matmul_precision != "highest":
        set_matmul_precision(model, matmul_precision)
    return model


def set_matmul_precision(model: torch.nn.Module, precision: str, split_attention: bool = True) -> None:
    """Every quantized product of ``model`` at ``precision``. At "low" the attention's q/k/v split their activations
    in two int8 rows (``QuantLinear.set_matmul_precision``): q and k meet in the softmax, and their int8 rounding was
    the largest share of "low"'s logit error (docs/cpu-weights.md). ``split_attention=False`` leaves them whole (a
    drafter, whose outputs only propose)."""
    softmax_inputs = {m.qkv_proj for m in model.modules() if isinstance(m, Attention)} if split_attention else set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_matmul_precision(precision, split=precision == "low" and module in softmax_inputs)



def _install_gguf_weights(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> set[str]:
    """Swap in quantized modules for the GGUF's block-format matrices; returns the parameter names they
    replace (the float loader skips them)."""
    source = cfg.gguf_path
    if source is None:
        raise ValueError(f"quantization: 'gguf' needs a model loaded from a .gguf file; {cfg.path} is a Hugging "
                         "Face folder (use quantization='int8' or None)")
    from eyas.model.gguf_layout import quantized_weights

    shards: dict[str, dict[int, object]] = {}
    counts: dict[str, int] = {}
    for hf_name, weight in quantized_weights(source, cfg.path).items():
        target = model.load_name(hf_name)
        if target is None:
            continue
        name, shard, count = target
        shards.setdefault(name, {})[shard or 0] = weight
        counts[name] = count
    for name, parts in shards.items():
        if len(parts) != counts[name]:
            raise ValueError(f"gguf: {source} has {len(parts)} of the {counts[name]} parts of {name} in a block format")
    arena = Arena(sum(w.data.numel() for parts in shards.values() for w in parts.values()))
    for name, parts in shards.items():
        path = name.removesuffix(".weight")
        module = model.get_submodule(path)
        ordered = [parts[i] for i in range(counts[name])]
        if isinstance(module, torch.nn.Embedding):
            model.set_submodule(path, QuantEmbedding(QuantWeight.cat(ordered, arena), dtype))
        else:
            model.set_submodule(path, QuantLinear.stacked(ordered, module.bias, arena))
    if cfg.tie_word_embeddings and isinstance(model.embed_tokens, QuantEmbedding):
        model.lm_head = QuantLinear([model.embed_tokens.weight_q])
        shards["lm_head.weight"] = {}
    return set(shards)


QUANTIZERS = {"I8_ROW": quantize_int8, "Q8_0": quantize_q8_0}  # the formats eyas makes from float weights at load


def linears_to_int8(model: torch.nn.Module, fmt: str = "I8_ROW") -> None:
    """Every ``Linear`` of ``model`` whose rows are whole 32-weight blocks becomes int8 rows of ``fmt``: per-output-
    channel ``I8_ROW`` (``quantization="int8"``) or ``Q8_0`` blocks (a drafter beside a quantized target), copied
    into one arena (a tied head gets its own copy)."""
    linears = [(path, m) for path, m in model.named_modules()
               if isinstance(m, Linear) and m.in_features % KERNEL_ALIGN == 0]
    block = FORMATS[fmt]
    arena = Arena(sum(m.weight.numel() // block.block_size * block.block_bytes for _, m in linears))
    for path, module in linears:
        bias = None if module.bias is None else module.bias.detach()
        model.set_submodule(path, QuantLinear([QUANTIZERS[fmt](module.weight, arena)], bias))


def _install_bf16(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every ``Linear`` and the embedding become bfloat16 rows; a tied head shares the embedding's rows, as
    the float model shares its tensor."""
    table = to_bf16(model.embed_tokens.weight)
    linears_to_bf16(model, {id(model.embed_tokens.weight): table})
    model.embed_tokens = QuantEmbedding(table, dtype)


def linears_to_bf16(model: torch.nn.Module, shared: dict[int, QuantWeight] | None = None) -> None:
    """Every ``Linear`` of ``model`` whose rows are whole 32-weight blocks becomes BF16 rows, copied into
    one arena; one whose weight tensor is a key (``id``) of ``shared`` reads those rows instead."""
    shared = shared or {}
    linears = [(path, m) for path, m in model.named_modules()
               if isinstance(m, Linear) and m.in_features % KERNEL_ALIGN == 0]
    arena = Arena(2 * sum(m.weight.numel() for _, m in linears if id(m.weight) not in shared))
    for path, module in linears:
        weight = shared.get(id(module.weight)) or to_bf16(module.weight, arena)
        bias = None if module.bias is None else module.bias.detach()
        model.set_submodule(path, QuantLinear([weight], bias))


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, file: Path) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"model: tensor '{name}' in {file} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
