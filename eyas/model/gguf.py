"""Convert a GGUF file into a standard Hugging Face model folder.

The folder holds ``config.json``, ``model.safetensors`` (float32, HF tensor names),
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``, so the rest of
eyas only ever reads one format. Supported architectures: llama, qwen2, qwen3.

Two facts about GGUF that the conversion must undo:

* Tensor shapes are stored in ggml "ne" order, the reverse of torch's: a GGUF ``[576, 1536]``
  ``ffn_gate`` is the torch ``[1536, 576]`` ``gate_proj.weight``. ``gguf.quants.dequantize``
  already returns the torch order.
* For llama, llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of every head
  from HF's rotate-half layout to GGML's interleaved rope layout; ``gguf_layout.unpermute_rope_rows``
  inverts it. Qwen GGUFs are written without the permutation.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from eyas.model.gguf_layout import MARKER_FILE, hf_tensor_name, unpermute_rope_rows

# general.architecture -> (HF architectures entry, HF model_type)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# tokenizer.ggml.pre -> pre-tokenizer. The regexes are those of llama.cpp's pre-tokenizer types.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_FAMILY = ("default", "gpt2", "gpt-2")

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def read_metadata(reader: GGUFReader) -> dict:
    """All GGUF key/values as Python values (strings, numbers, bools, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _f32(value: float) -> float:
    """Shortest decimal of a float32 metadata value: 9.999999747e-06 -> 1e-05."""
    return float(str(np.float32(value)))


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """HF ``config.json`` contents for a GGUF's metadata."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"gguf: general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hf_arch, model_type = SUPPORTED_ARCHITECTURES[arch]

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"gguf: metadata key {arch}.{key!r} is missing")
        return value

    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(
            f"gguf: rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported; "
            "only plain rope is"
        )
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


def state_dict(reader: GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    """All tensors, dequantized to float32, under HF names (q/k un-permuted for llama)."""
    permuted = config["model_type"] == "llama"
    out = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type)
        expected = tuple(int(n) for n in reversed(tensor.shape))
        assert array.shape == expected, (tensor.name, array.shape, expected)
        w = torch.from_numpy(np.array(array, dtype=np.float32))  # copy: F32 data is a read-only memmap
        if permuted and ".attn_q." in tensor.name:
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif permuted and ".attn_k." in tensor.name:
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        out[name] = w.contiguous()
    return out


def tensor_table(reader: GGUFReader) -> list[dict]:
    """Where each matrix lives in the file: name, GGML type name, torch shape [N, K] and byte offset. Kept
    in the converted folder, so the weights can later be mapped without parsing the GGUF's metadata
    again (GGUFReader builds an object per vocabulary entry, tens of MB of heap)."""
    return [{"name": t.name, "type": t.tensor_type.name, "shape": [int(t.shape[1]), int(t.shape[0])],
             "offset": int(t.data_offset)} for t in reader.tensors if len(t.shape) == 2]


def _pre_tokenizer(pre: str):
    """(normalizer, pre_tokenizer) for a llama.cpp ``tokenizer.ggml.pre`` name."""
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return None, pre_tokenizers.Sequence(
            [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _GPT2_FAMILY:
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split_regex = {"llama-bpe": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if split_regex is None:
        raise ValueError(
            f"gguf: tokenizer.ggml.pre {pre!r} is not supported; supported: "
            f"{', '.join(('smollm', 'llama-bpe', 'qwen2', *_GPT2_FAMILY))}"
        )
    split = pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    normalizer = normalizers.NFC() if pre == "qwen2" else None
    return normalizer, pre_tokenizers.Sequence([split, byte_level])


def build_tokenizer(meta: dict) -> HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"gguf: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    normalizer, pre_tok = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    # Both kinds already have vocab ids; adding them only makes them match before BPE.
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return tok


def _token(meta: dict, name: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]


def tokenizer_config(meta: dict, config: dict) -> dict:
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token(meta, "bos"),
        "eos_token": _token(meta, "eos"),
        "unk_token": _token(meta, "unknown"),
        "pad_token": _token(meta, "padding"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, source_info: dict | None = None) -> Path:
    """Convert ``gguf_path`` into the HF folder ``out_dir`` and return ``out_dir``.

    Everything is written into a temporary sibling folder, ``MARKER_FILE`` (holding
    ``source_info``) last, then renamed into place, so ``out_dir`` is either absent or complete.
    If another process finished the same folder first, its result is kept.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    config = hf_config(meta, {t.name for t in reader.tensors})
    tokenizer = build_tokenizer(meta)  # fail on an unsupported tokenizer before dequantizing

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(state_dict(reader, config), tmp / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / MARKER_FILE, {"source": str(gguf_path), **(source_info or {}), "tensors": tensor_table(reader)})
        for file in tmp.iterdir():
            file.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp creates it private
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
