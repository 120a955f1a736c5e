"""Which weight format and which products a model gets on this machine, and why: the policy behind
``quantization="auto"`` and ``matmul_precision="auto"``, from the CPU's flags and measured speeds
(``eyas.kernels``). Each choice comes with the reason that ``LLM`` logs."""

from __future__ import annotations

import torch

from eyas.config import ModelConfig

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names
QUANTIZATIONS = ("auto", None, "gguf", "int8", "bf16")
# matmul precision "auto" takes "medium" where a core's bf16 dot products do at least this many times the multiply-adds
# of its float32 FMAs (eyas.kernels.bf16_mac_ratio; docs/cpu-weights.md has what it measured)
BF16_PRODUCTS_MIN_RATIO = 1.5


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def resolve_quantization(requested: str | None, model: ModelConfig, device: torch.device,
                         dtype: str | torch.dtype = "auto") -> tuple[str | None, str]:
    """The weight format and why. ``"auto"``: a model loaded from a GGUF file keeps its block formats on a
    CPU (as llama.cpp runs it) and is dequantized to the engine dtype on CUDA; an HF folder with the
    ``"auto"`` dtype runs with bfloat16 weights (``"bf16"``) on a CPU with native bf16 dot products, and
    otherwise in the engine dtype. ``"gguf"``, ``"int8"``, ``"bf16"``: CPU only (eyas's own kernels,
    float32 activations). None: the engine dtype."""
    from eyas.model.quantized import kernel_available
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
        return _folder_weights(model, device, dtype)
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

def resolve_matmul_precision(requested: str, quantization: str | None,
                             model: ModelConfig | None = None) -> tuple[str, str]:
    """The products of eyas's CPU weight kernels -> (precision, why). ``"highest"``: float32 products;
    ``"medium"``: activations and weights rounded to bfloat16, float32 sums (AVX512-BF16), as
    ``torch.set_float32_matmul_precision("medium")`` allows; ``"low"``: int8 activations per block of 32 and
    integer dot products (q8_gemm.c), the q/k/v products on activations split in two int8 rows. ``"auto"``: low for
    a GGUF ``model`` whose matrices are all Q4_0, Q4_1 or Q8_0 (read interleaved, ``INTERLEAVED``) on a CPU with
    VNNI dot products: on the default model its logits stay closer to HF float32 than llama.cpp's and its steps are
    the fastest (docs/cpu-weights.md); else medium where it runs (the weights on eyas's kernels, a CPU whose bf16 dot products
    do at least ``BF16_PRODUCTS_MIN_RATIO`` times the multiply-adds of its float32 FMAs,
    ``eyas.kernels.bf16_mac_ratio``), as vLLM's CPU backend multiplies in bfloat16; highest elsewhere."""
    from eyas.kernels import bf16_mac_ratio, cpu_flags
    from eyas.model.quantized import MATMUL_PRECISIONS, dot_products, kernel_available

    _require(requested == "auto" or requested in MATMUL_PRECISIONS, f"matmul_precision: {requested!r} is not "
             f"one of {', '.join(map(repr, ('auto', *MATMUL_PRECISIONS)))}")
    if requested == "auto":
        if quantization is None:
            return "highest", "the weights run in the engine dtype"
        if quantization == "gguf" and model is not None and _interleaved_with_vnni(model):
            return "low", (f"int8 activations (q/k/v split in two int8 rows), integer dot products ({dot_products()}) "
                           "on the interleaved rows (--matmul-precision highest: float32)")
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

def _interleaved_with_vnni(model: ModelConfig) -> bool:
    """Whether "low" reads every matrix of the GGUF ``model`` interleaved, with VNNI dot products on this CPU."""
    from eyas.kernels import dot_variant
    from eyas.model.quantized import kernel_available

    return _interleavable(model) and dot_variant("q8_gemm") is not None and kernel_available("low")


def _interleavable(model: ModelConfig) -> bool:
    """Whether ``model`` is a GGUF whose every matrix "low" reads interleaved, on a CPU whose flags have VNNI dot
    products (no kernel is built to tell)."""
    from eyas.kernels import VARIANTS, variant_supported
    from eyas.model.gguf_layout import matrix_formats
    from eyas.model.quantized import INTERLEAVED

    return (model.gguf_path is not None and matrix_formats(model.path) - {"F32"} <= set(INTERLEAVED)
            and any(kernel == "q8_gemm" and variant_supported(v) for v, (kernel, *_) in VARIANTS.items()))


def bf16_products_needed(quantization: str | None, matmul_precision: str, model: ModelConfig) -> bool:
    """Whether an engine asked for these may run or measure bfloat16 products (``eyas.kernels``' ``bf16_products``
    build): where "medium" is asked for, or where "auto" may take it; not where "auto" takes "low" (``model`` a
    GGUF read interleaved with VNNI) or the weights are in the engine dtype. From the CPU's flags and the model's
    formats alone, so an engine's first run can leave that build out (``kernels.Builds.skip``)."""
    if matmul_precision == "medium":
        return True
    return matmul_precision == "auto" and quantization is not None and not (
        quantization in ("auto", "gguf") and _interleavable(model))


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


def _unaligned_widths(model: ModelConfig) -> list[int]:
    """The matrix input widths (hidden, attention output, MLP) that are not whole 32-weight rows."""
    widths = (model.hidden_size, model.num_heads * model.head_dim, model.intermediate_size)
    return [w for w in widths if w % 32]
