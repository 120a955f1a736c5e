"""Tokenizer, chat template and streaming detokenizer, checked against transformers' tokenizer
for the same GGUF (an independent conversion of the same metadata)."""

import json

import jinja2
import pytest
from test_gguf import TINY_TEMPLATE, write_tiny_gguf
from tokenizers import Regex, pre_tokenizers

from eyas.model.detokenizer import IncrementalDetokenizer
from eyas.model.gguf import _LLAMA3_REGEX, convert_gguf
from eyas.model.resolve import default_gguf_path, resolve_model
from eyas.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Pi is 3.14159, 2**10 == 1024, x1y22z333 and 1,000,000.",
    "  leading spaces,\ttabs\t\tand\n\n\ntrailing   ",
    "naïve café, Ünïcödé, 日本語のテキスト, 中文, русский, العربية",
    "emoji 🎉👩‍👩‍👧 🇫🇷 ✨",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special inside text: a<|endoftext|>b <|im_end|>",
    "I'm sure they've done it; we'll see. DON'T",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔"},
    ],
    [
        {"role": "system", "content": "You speak French."},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Bonjour ! Comment ça va ?"},
        {"role": "user", "content": "  Bien, merci.\n"},
    ],
]


# --- tiny folder, no real model needed ------------------------------------------------------------


@pytest.fixture
def tiny_folder(tmp_path):
    return convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", "llama"), tmp_path / "hf")


def test_eos_ids_from_all_config_files(tiny_folder):
    (tiny_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tiny_folder / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2, 7, 9})


def test_add_bos_token_from_tokenizer_config(tiny_folder):
    assert Tokenizer.from_folder(tiny_folder).encode(" the") == [261]  # merges Ġ t, h e, Ġt he
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.encode(" the") == [1, 261]
    assert tok.encode(" the", add_special_tokens=False) == [261]
    assert tok.decode([1, 261]) == " the"
    assert tok.decode([1, 261], skip_special_tokens=False) == "<|im_start|> the"


def test_chat_template_features(tiny_folder):
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.chat_template == TINY_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' + m.content) }}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    )
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '{"role": "user", "content": "é"}\n<|im_start|>'
    with pytest.raises(jinja2.TemplateError, match="no tools: x"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_llama3_pre_tokenizer_groups_digits_by_three():
    split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), "isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("abc 1234567 I'm\n\nok  ")]
    assert pieces == ["abc", " ", "123", "456", "7", " I", "'m", "\n\n", "ok", "  "]


def test_missing_tokenizer_json_is_actionable(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json does not exist"):
        Tokenizer.from_folder(tmp_path)


# --- the real default model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers_pair():
    """(eyas tokenizer of the converted default model, transformers' tokenizer of its GGUF)."""
    path = default_gguf_path()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Tokenizer.from_folder(resolve_model(None)), hf


@pytest.mark.slow
def test_default_tokenizer_special_tokens(tokenizers_pair):
    tok, hf = tokenizers_pair
    assert tok.vocab_size == len(hf) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, frozenset({2}))
    assert tok.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_default_tokenizer_matches_transformers(tokenizers_pair, text):
    tok, hf = tokenizers_pair
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]  # no bos added: tokenizer.ggml.add_bos_token is false
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids) == text
    # smollm pre-tokenizer: every digit is its own token
    assert all(len(tok.decode([i]).strip()) == 1 for i in ids if tok.decode([i]).strip().isdigit())


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_chat_template_matches_transformers(tokenizers_pair, messages, add_generation_prompt):
    tok, hf = tokenizers_pair
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_detokenizer_holds_back_split_characters(tokenizers_pair, chunk):
    tok, _ = tokenizers_pair
    text = "<|im_start|>日本語のテキスト 🎉👩‍👩‍👧 café ✨ 中文 done<|im_end|>"
    ids = tok.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
        if chunk == 1:
            assert "" in deltas  # some characters really were split across tokens


@pytest.mark.slow
def test_incremental_detokenizer_flushes_incomplete_tail(tokenizers_pair):
    tok, _ = tokenizers_pair
    ids = tok.encode("ok 🎉")
    *head, last = ids
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in head)
    assert "\ufffd" not in text
    assert text + detok.flush() == tok.decode(head)  # the stream stopped mid-character
