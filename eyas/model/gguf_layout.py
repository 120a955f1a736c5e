"""Where a GGUF file's tensors live and what Hugging Face calls them, without the ``gguf`` package.

The converter (``eyas.model.gguf``) parses a GGUF once, with the ``gguf`` package, and keeps a
table of its matrices (name, GGML type, torch shape, byte offset) in the converted folder. Every
later load reads that table and maps the block-format matrices straight from the file, so a
process that serves a converted model never imports ``gguf`` (about 3 MB of resident memory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

# Written last inside the converted folder; its presence means the folder is complete.
MARKER_FILE = "eyas-gguf.json"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (interleaved rope -> HF rotate-half).

    Within each head of D rows, GGUF row ``2*j + half`` holds HF row ``half*D/2 + j``.
    Example, D = 4: GGUF rows [a0, b0, a1, b1] -> HF rows [a0, a1, b0, b1].
    """
    rest = w.shape[1:]
    # [n_head, D/2, 2, *rest] -> [n_head, 2, D/2, *rest]
    return w.reshape(n_head, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def hf_tensor_name(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"gguf: tensor {name!r} has no Hugging Face equivalent in eyas' converter")


def read_tensor_table(folder: Path) -> list[dict]:
    return json.loads((Path(folder) / MARKER_FILE).read_text())["tensors"]


def matrix_formats(folder: Path) -> set[str]:
    """The formats of the GGUF's matrices (GGML type names, e.g. {"Q4_1", "Q8_0"}), from its converted folder."""
    return {t["type"] for t in read_tensor_table(folder)}


def quantized_weights(gguf_path: str | os.PathLike, folder: Path) -> dict[str, object]:
    """The matrices of a GGUF file in their own block formats: HF name -> ``QuantWeight`` (q/k rows
    un-permuted for llama), each a view of the file's copy-on-write mapping until the caller copies
    it. Float32 matrices are left to the float loader; any other format is refused, naming it and the
    supported ones. ``folder``: the file's converted folder (its tensor table and config)."""
    from eyas.model.quantized import FORMATS, QuantWeight

    config = json.loads((Path(folder) / "config.json").read_text())
    mapped = np.memmap(gguf_path, dtype=np.uint8, mode="c")
    permuted = config["model_type"] == "llama"
    out = {}
    for entry in read_tensor_table(folder):
        kind, (n, k) = entry["type"], entry["shape"]
        if kind == "F32":
            continue
        if kind not in FORMATS:
            raise ValueError(f"gguf: tensor {entry['name']!r} is in {kind}, which quantization='gguf' cannot compute "
                             f"with; supported: {', '.join(f for f in FORMATS if f != 'I8_ROW')} (or load the model "
                             f"with quantization=None to dequantize it)")
        fmt = FORMATS[kind]
        row_bytes = k // fmt.block_size * fmt.block_bytes
        rows = torch.from_numpy(mapped[entry["offset"]:entry["offset"] + n * row_bytes].reshape(n, row_bytes))
        if permuted and ".attn_q." in entry["name"]:
            rows = unpermute_rope_rows(rows, config["num_attention_heads"])
        elif permuted and ".attn_k." in entry["name"]:
            rows = unpermute_rope_rows(rows, config["num_key_value_heads"])
        out[hf_tensor_name(entry["name"])] = QuantWeight(rows, fmt, k)
    return out
