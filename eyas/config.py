"""Frozen settings for the model, KV cache, scheduler and engine.

All user-facing validation lives here: each check raises ``ValueError`` naming the
field, the bad value and what is allowed. Derived values are properties.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names
QUANTIZATIONS = ("auto", None, "gguf", "int8", "bf16")
# matmul precision "auto" takes "medium" where a core's bf16 dot products do at least this many times the multiply-adds
# of its float32 FMAs (eyas.kernels.bf16_mac_ratio; AMD Zen 4: 2.0, with which medium measured 1.6x at 16 rows and
# level at one; Intel Sapphire Rapids: 0.5 in an earlier measurement)
BF16_PRODUCTS_MIN_RATIO = 1.5


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
        from eyas.model.registry import architecture_traits  # lazy: model imports config

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
    speculative: Any = None  # eyas.spec.config.SpeculativeConfig; None = no speculation
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
    def resolve_quantization(requested: str | None, model: ModelConfig, device: torch.device,
                             dtype: str | torch.dtype = "auto") -> tuple[str | None, str]:
        """The weight format and why. ``"auto"``: a model loaded from a GGUF file keeps its block formats on a
        CPU (as llama.cpp runs it) and is dequantized to the engine dtype on CUDA; an HF folder with the
        ``"auto"`` dtype runs with bfloat16 weights (``"bf16"``) on a CPU with native bf16 dot products, and
        otherwise in the engine dtype. ``"gguf"``, ``"int8"``, ``"bf16"``: CPU only (eyas's own kernels,
        float32 activations). None: the engine dtype."""
        from eyas.model.quantized import kernel_available  # lazy: config is imported by the model code
        _require(requested in QUANTIZATIONS, f"quantization: {requested!r} is not one of "
                 f"{', '.join(map(repr, QUANTIZATIONS))}")
        from_gguf = model.gguf_path is not None
        if requested in ("gguf", "int8", "bf16"):
            _require(device.type == "cpu", f"quantization: {requested!r} runs on the CPU (eyas's own kernels); on "
                     f"CUDA use quantization='auto' or None (a GGUF is dequantized to the CUDA dtype at load)")
            _require(requested != "gguf" or from_gguf, f"quantization: 'gguf' needs a model loaded from a .gguf "
                     f"file, and {model.path} is a Hugging Face folder (use 'int8', 'bf16' or None)")
            _require(kernel_available(), f"quantization: {requested!r} needs eyas's quantized CPU kernel, which "
                     "could not be built (is a C compiler installed? set CC); use quantization=None")
            if requested != "gguf":
                odd = _unaligned_widths(model)
                _require(not odd, f"quantization: {requested!r} computes rows of 32 weights, and {model.path} has "
                         f"matrices {', '.join(map(str, odd))} wide; use quantization=None")
            return requested, "asked for"
        if requested is None:
            return None, "asked for"
        if not from_gguf:
            return EngineConfig._folder_weights(model, device, dtype)
        if device.type != "cpu":
            return None, "a GGUF model is dequantized to the CUDA dtype at load"
        if not kernel_available():
            return None, ("eyas's quantized CPU kernel could not be built (no C compiler?), so the GGUF weights "
                          "are dequantized to the engine dtype")
        from eyas.model.gguf_layout import matrix_formats
        from eyas.model.quantized import FORMATS

        unsupported = sorted(matrix_formats(model.path) - set(FORMATS) - {"F32"})
        if unsupported:
            return None, (f"the GGUF holds {', '.join(unsupported)}, which eyas's kernels do not compute with, so it "
                          "is dequantized to the engine dtype")
        return "gguf", "a GGUF model keeps its own block formats on the CPU, as llama.cpp runs it"

    @staticmethod
    def resolve_matmul_precision(requested: str, quantization: str | None) -> tuple[str, str]:
        """The products of eyas's CPU weight kernels -> (precision, why). ``"highest"``: float32 products;
        ``"medium"``: activations and weights rounded to bfloat16, float32 sums (AVX512-BF16), as
        ``torch.set_float32_matmul_precision("medium")`` allows. ``"auto"``: medium where it runs (the weights
        on eyas's kernels, a CPU whose bf16 dot products do at least ``BF16_PRODUCTS_MIN_RATIO`` times the
        multiply-adds of its float32 FMAs, ``eyas.kernels.bf16_mac_ratio``), as vLLM's CPU backend multiplies in
        bfloat16; highest elsewhere. ``"low"`` (int8 activations per block of 32, integer dot products: q8_gemm.c)
        only when asked for: on the default model its logits were further from float32 than HF's own bfloat16
        model's and it ran no faster than "highest" (docs/cpu-weights.md)."""
        from eyas.kernels import bf16_mac_ratio, cpu_flags
        from eyas.model.quantized import MATMUL_PRECISIONS, dot_products, kernel_available

        _require(requested == "auto" or requested in MATMUL_PRECISIONS, f"matmul_precision: {requested!r} is not "
                 f"one of {', '.join(map(repr, ('auto', *MATMUL_PRECISIONS)))}")
        if requested == "auto":
            if quantization is None:
                return "highest", "the weights run in the engine dtype"
            if not kernel_available("medium"):
                return "highest", ("float32 products: this CPU has no AVX512-BF16" if "avx512_bf16" not in cpu_flags()
                                   else "float32 products: eyas's AVX512-BF16 kernel is not built here (EYAS_CPU_ISA)")
            ratio = bf16_mac_ratio()
            if ratio < BF16_PRODUCTS_MIN_RATIO:
                return "highest", (f"float32 products: this CPU's bfloat16 dot products do {ratio:.2f}x the "
                                   "multiply-adds per second of its float32 FMAs, too few to pay for their roundings")
            return "medium", (f"bfloat16 products, float32 sums: this CPU's bfloat16 dot products do {ratio:.2f}x the "
                              "multiply-adds per second of its float32 FMAs (--matmul-precision highest: float32)")
        if requested == "medium":
            _require(quantization is not None, "matmul_precision: 'medium' applies to eyas's CPU kernels, and these "
                     "weights run in the engine dtype (quantization None); use quantization 'gguf', 'int8' or 'bf16'")
            _require(kernel_available("medium"), "matmul_precision: 'medium' needs a CPU with AVX512-BF16 "
                     f"(avx512_bf16: {'yes' if 'avx512_bf16' in cpu_flags() else 'no'}), eyas's AVX512 kernel build "
                     "(EYAS_CPU_ISA unset or avx512) and a C compiler; use 'highest'")
            return "medium", "bfloat16 products, float32 sums (asked for)"
        if requested == "low":
            _require(quantization is not None, "matmul_precision: 'low' applies to eyas's CPU kernels, and these "
                     "weights run in the engine dtype (quantization None); use quantization 'gguf' or 'int8'")
            _require(kernel_available("low"), "matmul_precision: 'low' needs a C compiler for eyas's integer "
                     "kernel (eyas/kernels/q8_gemm.c); use 'highest'")
            return "low", f"int8 activations per block of 32, integer dot products ({dot_products()}) (asked for)"
        return "highest", "float32 products (asked for)"

    @staticmethod
    def _folder_weights(model: ModelConfig, device: torch.device, dtype: str | torch.dtype) -> tuple[str | None, str]:
        """``"auto"`` for an HF folder: bfloat16 weights where the CPU multiplies bf16 natively."""
        from eyas.kernels import cpu_flags
        from eyas.model.quantized import kernel_available

        if device.type != "cpu":
            return None, "a Hugging Face folder runs in the engine dtype on CUDA"
        if dtype != "auto":
            return None, f"dtype {dtype} was asked for"
        if not cpu_flags() & NATIVE_BF16_FLAGS:
            return None, "this CPU has no native bf16 dot products (avx512_bf16 or amx_bf16), so float32 is faster"
        if not kernel_available():
            return None, "eyas's quantized CPU kernel could not be built (no C compiler?)"
        odd = _unaligned_widths(model)
        if odd:
            return None, f"the model has matrices {', '.join(map(str, odd))} wide, and the bf16 kernel computes rows of 32 weights"
        return "bf16", "this CPU has native bf16 dot products (weights in bfloat16, activations in float32)"

    @staticmethod
    def resolve_device(device: str | torch.device | None) -> torch.device:
        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        _require(device.type in ("cpu", "cuda"), f"device: '{device}' must be 'cpu' or 'cuda'")
        _require(device.type != "cuda" or torch.cuda.is_available(),
                 "device: 'cuda' was asked for but torch sees no CUDA device")
        return device


def _unaligned_widths(model: ModelConfig) -> list[int]:
    """The matrix input widths (hidden, attention output, MLP) that are not whole 32-weight rows."""
    widths = (model.hidden_size, model.num_heads * model.head_dim, model.intermediate_size)
    return [w for w in widths if w % 32]


def max_model_len_for(model: ModelConfig, requested: int | None) -> int:
    if requested is None:
        return min(model.max_position_embeddings, 8192)
    _require(1 < requested <= model.max_position_embeddings,
             f"max_model_len: {requested} must be in [2, {model.max_position_embeddings}] "
             f"(the model's max_position_embeddings)")
    return requested


__all__ = ["ModelConfig", "CacheConfig", "SchedulerConfig", "EngineConfig", "max_model_len_for"]
