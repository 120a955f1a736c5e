"""Tiny random HF checkpoints (saved with transformers itself) and a byte-level tokenizer for them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320  # 256 byte tokens + specials + spare ids
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}))


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=258, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, head_dim=16, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=10000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(rope_theta=10000.0, head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random init is small; widen it so logits differ meaningfully between tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    return folder
