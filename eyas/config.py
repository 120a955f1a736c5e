"""Frozen settings for the model, KV cache, scheduler and engine.

Each check raises ``ValueError`` naming the field, the bad value and what is allowed. Derived values are
properties. Which weight format and products a CPU gets is the model layer's policy (``eyas.model.weight_policy``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.model.registry import architecture_traits  # a leaf: it imports no other part of eyas

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters read from an HF ``config.json``."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    gguf_path: Path | None = None  # the GGUF file the folder was converted from (its block formats can be kept)

    @classmethod
    def from_folder(cls, path: str | os.PathLike, gguf_path: str | os.PathLike | None = None) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        _require(config_file.is_file(), f"model: no config.json in '{path}'")
        hf = json.loads(config_file.read_text())

        archs = hf.get("architectures") or [""]
        traits = architecture_traits(archs[0], config_file)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        generation = path / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            path=path,
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=traits.attention_bias or hf.get("attention_bias", False),
            qk_norm=traits.qk_norm,
            rope_scaling=hf.get("rope_scaling"),
            eos_token_ids=eos_ids,
            gguf_path=None if gguf_path is None else Path(gguf_path),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. ``num_blocks`` overrides the budget (tests use it to force preemption)."""

    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(self.block_size in (8, 16, 32, 64, 128),
                 f"block_size: {self.block_size} is not one of 8, 16, 32, 64, 128")
        _require(self.kv_cache_gb > 0, f"kv_cache_gb: {self.kv_cache_gb} must be > 0")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_kv_blocks: {self.num_blocks} must be >= 2 (one block is reserved for padding)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self):
        _require(self.max_num_seqs >= 1, f"max_num_seqs: {self.max_num_seqs} must be >= 1")
        _require(self.max_num_batched_tokens >= 16,
                 f"max_num_batched_tokens: {self.max_num_batched_tokens} must be >= 16")
        _require(self.max_model_len >= 2, f"max_model_len: {self.max_model_len} must be >= 2")


MAX_SPECULATIVE_TOKENS = 16  # the most drafts speculative_config.num_speculative_tokens may ask for


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (they are used on CUDA only)
    speculative: Any = None  # eyas.spec_decode.config.SpeculativeConfig; None = no speculation
    quantization: str | None = None  # None, "gguf", "int8" or "bf16" (see resolve_quantization)
    matmul_precision: str = "highest"  # the quantized weights' products (see resolve_matmul_precision)

    @property
    def max_positions(self) -> int:
        """Rotary table size: max_model_len plus room for a drafter's lookahead positions."""
        return self.scheduler.max_model_len + MAX_SPECULATIVE_TOKENS + 1

    @property
    def max_blocks_per_request(self) -> int:
        """The widest block table a request can have (``max_positions`` tokens)."""
        return -(-self.max_positions // self.cache.block_size)

    @staticmethod
    def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
        """``"auto"``: bfloat16 on CUDA; float32 on CPU (CPUs without AVX512-BF16 emulate bf16)."""
        if isinstance(dtype, torch.dtype):
            _require(dtype in _DTYPES.values(), f"dtype: {dtype} is not one of {sorted(_DTYPES)}")
            return dtype
        if dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        _require(dtype in _DTYPES, f"dtype: '{dtype}' is not one of 'auto', {', '.join(map(repr, _DTYPES))}")
        return _DTYPES[dtype]

    @staticmethod
    def resolve_device(device: str | torch.device | None) -> torch.device:
        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        _require(device.type in ("cpu", "cuda"), f"device: '{device}' must be 'cpu' or 'cuda'")
        _require(device.type != "cuda" or torch.cuda.is_available(),
                 "device: 'cuda' was asked for but torch sees no CUDA device")
        return device


def max_model_len_for(model: ModelConfig, requested: int | None) -> int:
    if requested is None:
        return min(model.max_position_embeddings, 8192)
    _require(1 < requested <= model.max_position_embeddings,
             f"max_model_len: {requested} must be in [2, {model.max_position_embeddings}] "
             f"(the model's max_position_embeddings)")
    return requested


__all__ = ["ModelConfig", "CacheConfig", "SchedulerConfig", "EngineConfig", "max_model_len_for"]
