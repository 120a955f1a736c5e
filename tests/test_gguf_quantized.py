"""Loading a GGUF in its own block formats (quantization='gguf'), in int8 and in bf16: the weights the
kernels compute with are exactly the gguf package's dequantization (or the stated rounding of the float
weights), and the model's logits match HF transformers on those weights."""

import dataclasses
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from kernel_helpers import without_c_compiler
from test_gguf import TINY_TOKENS, add_tiny_tokenizer
from test_quant_kernels import NEEDS_MEDIUM, PRECISIONS, random_weight

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.model import quantized as Q
from eyas.model.gguf import convert_gguf
from eyas.model.loader import load_model
from eyas.model.weight_policy import (
    BF16_PRODUCTS_MIN_RATIO,
    bf16_products_needed,
    resolve_matmul_precision,
    resolve_quantization,
)

pytestmark = pytest.mark.skipif(not Q.kernel_available(), reason="no C compiler: the quantized kernel cannot be built")

HIDDEN, FFN, N_HEAD, N_KV, HEAD_DIM = 256, 512, 4, 2, 64
# q and k differ in format, so the fused qkv weight takes one kernel call per run of one format
LAYER_FORMATS = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "Q6_K",
                 "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0"}


def write_quantized_gguf(path, tied=True, embed_format="Q8_0", arch="llama"):
    """A 2-layer random llama GGUF whose matrices are in the block formats eyas computes with."""
    vocab = len(TINY_TOKENS)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("head_count", N_HEAD), ("head_count_kv", N_KV),
                       ("key_length", HEAD_DIM), ("value_length", HEAD_DIM), ("vocab_size", vocab)]:
        getattr(w, f"add_{key}")(value)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-6)
    add_tiny_tokenizer(w, "smollm")
    seed = iter(range(1000))

    def add(name, fmt, n, k):
        if fmt == "F32":
            w.add_tensor(name, np.random.default_rng(next(seed)).standard_normal((n, k)).astype(np.float32))
            return
        if fmt in Q.FORMATS:
            data = random_weight(fmt, n, k, seed=next(seed))[0].data.numpy()
        else:  # a format eyas does not compute with: gguf's own quantizer makes it
            values = np.random.default_rng(next(seed)).standard_normal((n, k)).astype(np.float32) * 0.05
            data = gguf.quants.quantize(values, GGMLQuantizationType[fmt])
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[fmt])

    def norm(name):
        w.add_tensor(name, (1 + 0.1 * np.random.default_rng(next(seed)).standard_normal(HIDDEN)).astype(np.float32))

    add("token_embd.weight", embed_format, vocab, HIDDEN)
    norm("output_norm.weight")
    if not tied:
        add("output.weight", "Q6_K", vocab, HIDDEN)
    shapes = {"attn_q": (N_HEAD * HEAD_DIM, HIDDEN), "attn_k": (N_KV * HEAD_DIM, HIDDEN),
              "attn_v": (N_KV * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, N_HEAD * HEAD_DIM),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i in range(2):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for kind, fmt in LAYER_FORMATS.items():
            add(f"blk.{i}.{kind}.weight", fmt, *shapes[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dense(module) -> torch.Tensor:
    """The float32 weight a Linear or QuantLinear computes with."""
    if isinstance(module, Q.QuantLinear):
        return torch.cat([Q.dequantize(p) for p in module.parts])
    return module.weight.detach()


@pytest.mark.parametrize("tied", [True, False])
def test_every_matrix_equals_gguf_dequantization(tmp_path, tied):
    path = write_quantized_gguf(tmp_path / "q.gguf", tied=tied)
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)  # the converter dequantizes with gguf
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 256)
    quant = load_model(cfg, torch.float32, torch.device("cpu"), 256, quantization="gguf")
    linears = [n for n, m in quant.named_modules() if isinstance(m, Q.QuantLinear)]
    assert len(linears) == 2 * 4 + 1
    for name in linears:
        assert torch.equal(_dense(quant.get_submodule(name)), _dense(plain.get_submodule(name))), name
    qkv = quant.layers[0].self_attn.qkv_proj
    assert [p.fmt.name for p in qkv.parts] == ["Q4_K", "Q5_K"]  # q alone, then k and v fused in one run
    assert isinstance(quant.embed_tokens, Q.QuantEmbedding)
    assert torch.equal(Q.dequantize(quant.embed_tokens.weight_q), plain.embed_tokens.weight.detach())
    assert (quant.lm_head.parts[0] is quant.embed_tokens.weight_q) is tied
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in quant.parameters())  # no float matrices



@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", ["gguf", "int8", "bf16"])
def test_logits_match_transformers_on_the_same_weights(tmp_path, mode, precision):
    """HF transformers on the dequantized folder (gguf mode: the same weights; int8 / bf16: eyas's int8 /
    bf16 weights widened to float32) against eyas's prefill and decode logits: within float32 accumulation
    order with float32 products, within bfloat16 rounding of every product's inputs with "medium"."""
    import transformers
    from test_model_vs_hf import _eyas_logits_by_chunks

    path = write_quantized_gguf(tmp_path / "q.gguf", tied=False)
    folder = convert_gguf(path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(path), quantization=mode, max_model_len=256, kv_cache_gb=0.05, max_num_batched_tokens=64,
              matmul_precision=precision)
    if mode != "gguf":
        with torch.no_grad():
            if mode == "bf16":
                hf.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight.to(torch.bfloat16))
            for name, module in llm.engine.runner.model.named_modules():
                if isinstance(module, Q.QuantLinear):
                    dense = Q.dequantize(module.parts[0])
                    if name == "lm_head":
                        hf.lm_head.weight.copy_(dense)
                        continue
                    if name.endswith("qkv_proj"):  # fused in eyas: split back into HF's parts
                        q, k, v = dense.split([N_HEAD * HEAD_DIM, N_KV * HEAD_DIM, N_KV * HEAD_DIM])
                        layer = hf.model.get_submodule(name.removesuffix(".qkv_proj"))
                        layer.q_proj.weight.copy_(q), layer.k_proj.weight.copy_(k), layer.v_proj.weight.copy_(v)
                    elif name.endswith("gate_up_proj"):
                        gate, up = dense.chunk(2)
                        layer = hf.model.get_submodule(name.removesuffix(".gate_up_proj"))
                        layer.gate_proj.weight.copy_(gate), layer.up_proj.weight.copy_(up)
                    else:
                        hf.model.get_submodule(name).weight.copy_(dense)
    tokens = torch.randint(3, len(TINY_TOKENS), (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = _eyas_logits_by_chunks(llm, tokens)
    if precision == "highest":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        return
    # bfloat16 products: no further from float32 than HF's own model in bfloat16 (here max 0.04-0.07 against
    # 0.11, mean 0.002-0.003 against 0.005: the residual stream and the sums stay float32)
    with torch.no_grad():
        bf16 = hf.to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
    err, bf16_err = (got - ref).abs(), (bf16 - ref).abs()
    assert err.max() <= bf16_err.max() and err.mean() <= bf16_err.mean(), (err.max(), bf16_err.max())


@pytest.mark.skipif(not Q.kernel_available("low"), reason="no C compiler: the q8 kernel cannot be built")
def test_low_splits_the_attention_inputs_in_two_int8_rows(tmp_path):
    """At "low" the q/k/v products take their activations as two int8 rows (a block's quantization and what it
    leaves: on the default model plain int8 there was the largest share of the logit error), within a hundredth of
    plain int8's error of float32; every other product takes int8 activations."""
    path = write_quantized_gguf(tmp_path / "q.gguf", tied=True)
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    low, highest = (load_model(cfg, torch.float32, torch.device("cpu"), 256, quantization="gguf",
                               matmul_precision=precision) for precision in ("low", "highest"))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    for i in range(2):
        name = f"layers.{i}.self_attn.qkv_proj"
        module, want = low.get_submodule(name), highest.get_submodule(name)(x)
        split_err = (module(x) - want).abs().max()
        module.set_matmul_precision("low")
        int8_err = (module(x) - want).abs().max()
        assert 0 < split_err <= int8_err / 100, (name, split_err, int8_err)
    for name in ("layers.0.self_attn.o_proj", "layers.1.mlp.gate_up_proj", "lm_head"):  # all HIDDEN wide
        assert not torch.equal(low.get_submodule(name)(x), highest.get_submodule(name)(x)), name
    with pytest.raises(ValueError, match="split activations are a mode of matmul precision 'low'"):
        low.get_submodule("layers.0.self_attn.qkv_proj").set_matmul_precision("highest", split=True)


def test_int8_keeps_each_row_within_half_a_step(tmp_path):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 256)
    int8 = load_model(cfg, torch.float32, torch.device("cpu"), 256, quantization="int8")
    for name, module in int8.named_modules():
        if isinstance(module, Q.QuantLinear):
            (part,) = module.parts
            assert part.fmt.name == "I8_ROW"
            err = (Q.dequantize(part) - _dense(plain.get_submodule(name))).abs().max(dim=1).values
            assert (err <= part.scale * (0.5 + 1e-4)).all(), name  # + the rounding of q * scale
    assert isinstance(int8.embed_tokens, torch.nn.Embedding)  # the lookup table stays in the engine dtype


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_rows_are_the_float_weights_rounded_to_nearest_even(tmp_path, tied):
    path = write_quantized_gguf(tmp_path / "q.gguf", tied=tied)
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 256)
    bf16 = load_model(cfg, torch.float32, torch.device("cpu"), 256, quantization="bf16")
    checked = 0
    for name, module in plain.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            got = bf16.get_submodule(name)
            (part,) = got.parts if isinstance(got, Q.QuantLinear) else (got.weight_q,)
            assert part.fmt.name == "BF16"
            expected = module.weight.detach().to(torch.bfloat16).float()
            assert torch.equal(Q.dequantize(part), expected), name
            checked += 1
    assert checked == 2 + 4 * 2  # embedding, head, and per layer qkv, o, gate_up, down
    ids = torch.tensor([[3, 17, 40]])
    assert torch.equal(bf16.embed_tokens(ids), plain.embed_tokens.weight.detach()[ids].to(torch.bfloat16).float())
    shared = bf16.lm_head.parts[0] is bf16.embed_tokens.weight_q
    assert shared == tied  # a tied head reads the embedding's rows; no second copy


def test_unsupported_block_format_is_refused_by_name(tmp_path):
    path = tmp_path / "q5.gguf"
    write_quantized_gguf(path, embed_format="Q5_0")
    folder = convert_gguf(path, tmp_path / "hf")  # the converter dequantizes any format gguf knows
    from eyas.model.gguf_layout import quantized_weights

    with pytest.raises(ValueError, match=r"is in Q5_0, .*supported: F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K"):
        quantized_weights(path, folder)
    choice, why = resolve_quantization("auto", ModelConfig.from_folder(folder, path), torch.device("cpu"))
    assert choice is None and "holds Q5_0" in why


def test_quantization_choice(tmp_path):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    gguf_cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf_cfg, cpu)[0] == "gguf"
    assert resolve_quantization(None, gguf_cfg, cpu)[0] is None
    hf_cfg = ModelConfig.from_folder(tmp_path / "hf")  # the same folder, not known to come from a GGUF
    assert resolve_quantization("int8", hf_cfg, cpu)[0] == "int8"
    assert resolve_quantization("bf16", hf_cfg, cpu)[0] == "bf16"
    with pytest.raises(ValueError, match="'gguf' needs a model loaded from a .gguf file"):
        resolve_quantization("gguf", hf_cfg, cpu)
    with pytest.raises(ValueError, match="quantization: 'q3' is not one of"):
        resolve_quantization("q3", hf_cfg, cpu)
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_quantization("int8", hf_cfg, torch.device("cuda"))


@pytest.mark.parametrize("flags,dtype,expected,why", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "auto", "bf16", "native bf16 dot products"),
    ({"avx2", "fma", "amx_bf16"}, "auto", "bf16", "native bf16 dot products"),
    ({"avx2", "fma", "avx512f"}, "auto", None, "no native bf16 dot products"),
    ({"avx2", "fma", "avx512_bf16"}, "float32", None, "dtype float32 was asked for"),
    ({"avx2", "fma", "avx512_bf16"}, torch.bfloat16, None, "dtype torch.bfloat16 was asked for"),
])
def test_an_hf_folder_gets_bf16_weights_only_where_the_cpu_has_native_bf16(tmp_path, monkeypatch, flags, dtype,
                                                                             expected, why):
    from eyas import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    path = write_quantized_gguf(tmp_path / "q.gguf")
    hf_cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"))  # not known to come from a GGUF
    choice, reason = resolve_quantization("auto", hf_cfg, torch.device("cpu"), dtype)
    assert choice == expected and why in reason
    assert resolve_quantization("auto", hf_cfg, torch.device("cuda"), dtype)[0] is None
    odd = dataclasses.replace(hf_cfg, intermediate_size=FFN + 16)  # a matrix 528 weights wide
    choice, reason = resolve_quantization("auto", odd, torch.device("cpu"), dtype)
    assert choice is None and (expected is None or "matrices 528 wide" in reason)
    with pytest.raises(ValueError, match="'bf16' computes rows of 32 weights, .* has matrices 528 wide"):
        resolve_quantization("bf16", odd, torch.device("cpu"))


def test_matmul_precision_medium_is_refused_where_it_cannot_run_and_auto_takes_highest_there(monkeypatch):
    from eyas import kernels

    with pytest.raises(ValueError, match="matmul_precision: 'lowest' is not one of 'auto', 'highest', 'medium', 'low'"):
        resolve_matmul_precision("lowest", "gguf")
    with pytest.raises(ValueError, match=r"'medium' applies to eyas's CPU kernels, .*\(quantization None\)"):
        resolve_matmul_precision("medium", None)
    assert resolve_matmul_precision("highest", None)[0] == "highest"
    assert resolve_matmul_precision("auto", None) == ("highest", "the weights run in the engine dtype")
    expected = "medium" if Q.kernel_available("medium") and kernels.bf16_mac_ratio() >= BF16_PRODUCTS_MIN_RATIO \
        else "highest"
    assert resolve_matmul_precision("auto", "gguf")[0] == expected
    if Q.kernel_available("medium"):  # bf16 dot products slower than FMAs (as measured on Sapphire Rapids): highest
        with monkeypatch.context() as m:
            m.setattr(kernels, "bf16_mac_ratio", lambda: 0.5)
            precision, why = resolve_matmul_precision("auto", "bf16")
            assert precision == "highest" and "do 0.50x the multiply-adds" in why
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                                  "avx512vl"}))
    kernels.supported_isas.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"'medium' needs a CPU with AVX512-BF16 \(avx512_bf16: no\)"):
            resolve_matmul_precision("medium", "gguf")
        assert resolve_matmul_precision("auto", "gguf") == (
            "highest", "float32 products: this CPU has no AVX512-BF16")
    finally:
        kernels.supported_isas.cache_clear()
    if "avx2" in kernels.supported_isas() and "avx512_bf16" in kernels.cpu_flags():
        monkeypatch.setenv("EYAS_CPU_ISA", "avx2")  # a lesser build forced: no bf16 products either
        with pytest.raises(ValueError, match=r"avx512_bf16: yes\), eyas's AVX512 kernel build"):
            resolve_matmul_precision("medium", "int8")
        precision, why = resolve_matmul_precision("auto", "int8")
        assert precision == "highest" and "EYAS_CPU_ISA" in why


@pytest.mark.skipif(not Q.kernel_available("low"), reason="no C compiler: the q8 kernel cannot be built")
def test_auto_takes_low_for_interleaved_formats_on_a_cpu_with_vnni(tmp_path, monkeypatch):
    """"low" reads Q4_0 / Q4_1 / Q8_0 interleaved; auto takes it for a GGUF of only those, where VNNI runs."""
    from eyas import kernels
    from eyas.model import gguf_layout

    path = write_quantized_gguf(tmp_path / "q.gguf", tied=True)  # K-quants in its layers
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    old_rule = resolve_matmul_precision("auto", "gguf")
    assert resolve_matmul_precision("auto", "gguf", cfg) == old_rule
    monkeypatch.setattr(gguf_layout, "matrix_formats", lambda folder: {"Q4_1", "Q8_0", "F32"})
    if kernels.dot_variant("q8_gemm") is not None:  # this CPU has VNNI
        precision, why = resolve_matmul_precision("auto", "gguf", cfg)
        assert precision == "low" and "q/k/v split in two int8 rows" in why
    assert resolve_matmul_precision("auto", "int8", cfg) == resolve_matmul_precision("auto", "int8")
    monkeypatch.setattr(kernels, "dot_variant", lambda name: None)  # AVX2 only: vpmaddubsw, not measured to pay
    assert resolve_matmul_precision("auto", "gguf", cfg) == old_rule


def test_an_engine_skips_the_bf16_build_only_where_it_will_not_run_or_measure_it(tmp_path, monkeypatch):
    """``bf16_products_needed`` (read before any kernel is built) against what the policy then resolves: a GGUF
    that "auto" runs at "low" never needs the bfloat16 build; one with K-quants may ("auto" measures it)."""
    from eyas import kernels
    from eyas.model import gguf_layout

    path = write_quantized_gguf(tmp_path / "q.gguf", tied=True)  # K-quants in its layers
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    assert bf16_products_needed("auto", "auto", cfg) and bf16_products_needed("gguf", "auto", cfg)
    assert bf16_products_needed("int8", "medium", cfg) and bf16_products_needed("bf16", "auto", cfg)
    assert not any(bf16_products_needed(q, p, cfg) for q in ("auto", "int8") for p in ("highest", "low"))
    assert not bf16_products_needed(None, "auto", cfg)
    monkeypatch.setattr(gguf_layout, "matrix_formats", lambda folder: {"Q4_1", "Q8_0", "F32"})
    vnni = any(kernels.variant_supported(v) for v in ("amx", "vnni512", "vnni256"))
    assert bf16_products_needed("auto", "auto", cfg) == (not vnni)
    if vnni and Q.kernel_available("low") and kernels.dot_variant("q8_gemm") is not None:
        assert resolve_matmul_precision("auto", "gguf", cfg)[0] == "low"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                                 "avx512vl", "avx512_bf16"}))  # no VNNI
    assert bf16_products_needed("auto", "auto", cfg)


@NEEDS_MEDIUM
def test_the_bf16_throughput_probe_is_measured_once_per_cpu(tmp_path, monkeypatch):
    from eyas import kernels

    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path))
    ratio = kernels.bf16_mac_ratio()
    record = tmp_path / "kernels" / f"mac-ratio-{kernels.cpu_key()}.txt"
    assert 0.1 < ratio < 8 and float(record.read_text()) == ratio
    record.write_text("0.7")  # the record decides from now on
    assert kernels.bf16_mac_ratio() == 0.7


def test_without_a_compiler_auto_falls_back_and_gguf_is_refused(tmp_path, monkeypatch):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    cfg = ModelConfig.from_folder(convert_gguf(path, tmp_path / "hf"), path)
    with without_c_compiler(monkeypatch, tmp_path, Q._kernel):
        choice, why = resolve_quantization("auto", cfg, torch.device("cpu"))
        assert choice is None and "could not be built" in why
        with pytest.raises(ValueError, match="needs eyas's quantized CPU kernel, which could not be built"):
            resolve_quantization("gguf", cfg, torch.device("cpu"))
        with pytest.raises(ValueError, match="'medium' needs a CPU with AVX512-BF16 .* and a C compiler"):
            resolve_matmul_precision("medium", "gguf")


@pytest.mark.parametrize("precision", [*PRECISIONS, "low"])
def test_generation_in_gguf_mode_is_greedy_identical_with_speculation(tmp_path, precision):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 60, 61, 200, 7, 9, 60, 61, 200], [100, 101, 102, 100, 101, 102, 100, 101]]
    common = dict(quantization="gguf", kv_cache_gb=0.05, max_model_len=256, matmul_precision=precision)
    plain = LLM(str(path), **common)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(path), **common,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "draft_row_cost": 0.0})
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert spec.stats()["num_accepted"] > 0  # drafts were verified, and some kept


def test_serving_a_converted_gguf_needs_neither_the_gguf_package_nor_a_tokenizer_json_copy(tmp_path, monkeypatch):
    """The memory goal's two easy leaks: importing ``gguf`` (about 3 MB resident) and holding the
    tokenizer's JSON for a grammar compiler no request has used (about 3 MB on the default model)."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "cache"))
    LLM(str(path), quantization="gguf", kv_cache_gb=0.05, max_model_len=256)  # converts, with gguf
    child = (f"import sys; from eyas import LLM, SamplingParams; llm = LLM({str(path)!r}, quantization='gguf', "
             "kv_cache_gb=0.05, max_model_len=256); llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False); "
             "print('gguf' in sys.modules, isinstance(llm.engine.grammars._tokenizer_json, str))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]  # (test_structured_output covers the compiler once asked for)


