"""``eyas regenerate``: every reply replaced by the target's own greedy one, conditioned on the regenerated
history; a resumable journal that ``eyas train --online`` and ``eyas extract`` read as chat data."""

import json
import math
import random

import pytest

from eyas.data.sharegpt import iter_sharegpt
from eyas.jobs.regenerate import run_regenerate

WORDS = "falcon river hill stone wind light morning the a of sees flies over under".split()


def _write(path, conversations):
    with open(path, "w") as f:
        for i, messages in enumerate(conversations):
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")


def _random_chats(n: int, seed: int = 0):
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 20)))})
        chats.append(messages)
    return chats


def _greedy_history(llm, messages, max_tokens):
    """The independent reference: walk the conversation, asking the target for each reply in turn."""
    from eyas import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    history, cut = [], []
    for m in messages:
        if m["role"] == "assistant":
            out = llm.chat([history], params, use_tqdm=False)[0].outputs[0]
            history.append({"role": "assistant", "content": out.text})
            cut.append(out.finish_reason == "length")
        else:
            history.append(m)
    if history[-1]["role"] == "user":
        out = llm.chat([history], params, use_tqdm=False)[0].outputs[0]
        history.append({"role": "assistant", "content": out.text})
        cut.append(out.finish_reason == "length")
    return history, cut


def test_every_reply_is_the_targets_own_given_the_regenerated_history(tiny_models, tmp_path):
    from eyas import LLM

    chats = _random_chats(6) + [[{"role": "assistant", "content": "a leading reply"},
                                 {"role": "user", "content": "hello falcon"}],  # dropped; the question gets a reply
                                [{"role": "assistant", "content": "nothing to answer"}]]  # no user turn: skipped
    data = tmp_path / "chats.jsonl"
    _write(data, chats)
    out = tmp_path / "regen.jsonl"
    counts = run_regenerate(str(data), out, model=str(tiny_models["llama"]), max_tokens=6, max_len=1000,
                            chunk_size=3, progress=False, kv_cache_gb=0.02)
    assert counts["written"] == 7 and counts["skipped"] == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"{i:06d}" for i in range(8)]
    assert rows[-1]["skipped"] == "no user turn"
    llm = LLM(str(tiny_models["llama"]), max_model_len=1000, kv_cache_gb=0.02)
    for row, messages in zip(rows, chats):
        messages = messages[1:] if messages[0]["role"] == "assistant" else messages
        if "skipped" in row:
            continue
        expected, cut = _greedy_history(llm, messages, 6)
        assert row["messages"] == expected and row["truncated"] == cut
    read = list(iter_sharegpt(out))  # readable as chat data (the skipped line is not a conversation)
    assert [c.messages for c in read] == [r["messages"] for r in rows if "messages" in r]


def test_max_turns_and_max_len_end_conversations_early(tiny_models, tmp_path):
    messages = [{"role": "user", "content": "the falcon flies"}, {"role": "assistant", "content": "over a hill"},
                {"role": "user", "content": "and sees the river " * 6}, {"role": "assistant", "content": "shining"}]
    data = tmp_path / "chats.jsonl"
    _write(data, [messages])
    kwargs = dict(model=str(tiny_models["llama"]), max_tokens=8, progress=False, kv_cache_gb=0.02)
    run_regenerate(str(data), tmp_path / "one.jsonl", max_turns=1, max_len=200, **kwargs)
    one = json.loads((tmp_path / "one.jsonl").read_text())
    assert [m["role"] for m in one["messages"]] == ["user", "assistant"]
    # 60 tokens hold the first exchange but not the second prompt: the conversation ends after the first reply
    run_regenerate(str(data), tmp_path / "short.jsonl", max_len=60, **kwargs)
    short = json.loads((tmp_path / "short.jsonl").read_text())
    assert short["messages"] == one["messages"] and len(short["truncated"]) == 1


def test_resume_after_a_kill_goes_on_after_the_journaled_conversations(tiny_models, tmp_path):
    data = tmp_path / "chats.jsonl"
    _write(data, _random_chats(7, seed=1))
    kwargs = dict(model=str(tiny_models["llama"]), max_tokens=5, max_len=200, chunk_size=2, progress=False,
                  kv_cache_gb=0.02)
    whole = tmp_path / "whole.jsonl"
    run_regenerate(str(data), whole, **kwargs)
    out = tmp_path / "out.jsonl"
    run_regenerate(str(data), out, max_samples=4, **kwargs)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:17])  # killed while writing the fourth line
    counts = run_regenerate(str(data), out, **kwargs)
    assert counts["written"] == 4  # the torn line and the three never written
    assert out.read_text() == whole.read_text()
    with pytest.raises(ValueError, match=r"other settings \(max_tokens differ\)"):
        run_regenerate(str(data), out, **{**kwargs, "max_tokens": 6})
    with pytest.raises(ValueError, match="must name a .jsonl file"):
        run_regenerate(str(data), tmp_path / "regen.json", **kwargs)


def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny_models):
    from eyas import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02)
    prompts = [[1, 5, 9, 13], [2, 7]]
    a = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    b = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, detokenize=False), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(o.outputs[0].text == "" for o in b) and any(o.outputs[0].text for o in a)
    with pytest.raises(ValueError, match="stop.*detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


def test_sampled_replies_follow_the_targets_distribution_one_seed_per_reply(tiny_models, tmp_path):
    """120 copies of one question, one sampled token each: the replies are independent draws from the target's
    next-token distribution (a shared seed would give 120 equal replies), checked against its probabilities."""
    from eyas import LLM, SamplingParams

    question = [{"role": "user", "content": "the falcon sees"}]
    n = 120
    data = tmp_path / "same.jsonl"
    _write(data, [question] * n)
    out = tmp_path / "sampled.jsonl"
    run_regenerate(str(data), out, model=str(tiny_models["llama"]), max_tokens=1, max_len=200, chunk_size=50,
                   temperature=1.0, seed=7, progress=False, kv_cache_gb=0.02)
    replies = [json.loads(line)["messages"][-1]["content"] for line in out.read_text().splitlines()]
    llm = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02)
    top = llm.chat([question], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0].outputs[0]
    probs = {llm.get_tokenizer().decode([t]): math.exp(lp) for t, lp in top.logprobs[0].items()}
    assert max(probs.values()) < 0.2 and len(set(replies)) > n // 4  # a flat distribution: many distinct draws
    for text, p in probs.items():  # each of the top 5: its count within 4.5 standard deviations of n p
        if not text.strip() or "\ufffd" in text:  # special tokens and partial UTF-8 bytes share their text
            continue
        count = sum(r == text for r in replies)
        assert abs(count - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1, (text, count, n * p)


def test_sampled_regeneration_is_reproducible_and_resumes_to_the_same_file(tiny_models, tmp_path):
    data = tmp_path / "chats.jsonl"
    _write(data, _random_chats(7, seed=2))
    kwargs = dict(model=str(tiny_models["llama"]), max_tokens=6, max_len=300, progress=False, kv_cache_gb=0.02,
                  temperature=0.9, top_p=0.95, seed=3)
    whole = tmp_path / "whole.jsonl"
    run_regenerate(str(data), whole, chunk_size=7, **kwargs)
    out = tmp_path / "out.jsonl"  # other chunks, then a kill while writing the fourth line
    run_regenerate(str(data), out, max_samples=4, chunk_size=2, **kwargs)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:17])
    run_regenerate(str(data), out, chunk_size=3, **kwargs)
    assert out.read_text() == whole.read_text()
    greedy, other = tmp_path / "greedy.jsonl", tmp_path / "other.jsonl"
    run_regenerate(str(data), greedy, **{**kwargs, "temperature": 0.0})
    run_regenerate(str(data), other, **{**kwargs, "seed": 4})
    assert len({whole.read_text(), greedy.read_text(), other.read_text()}) == 3
    with pytest.raises(ValueError, match=r"other settings \(sampling differ\)"):
        run_regenerate(str(data), out, **{**kwargs, "temperature": 0.5})
    with pytest.raises(ValueError, match="temperature"):
        run_regenerate(str(data), tmp_path / "bad.jsonl", **{**kwargs, "temperature": -1.0})
    with pytest.raises(ValueError, match="seed"):
        run_regenerate(str(data), tmp_path / "bad.jsonl", **{**kwargs, "seed": -1})


def test_a_conversation_with_more_sampled_replies_than_seeds_is_refused(tiny_models, tmp_path, monkeypatch):
    """Conversation i's replies use seeds seed * 2**32 + i * ROUNDS + turn: a conversation past ROUNDS turns would
    reuse the next one's seeds, so it is refused (ROUNDS made 2 here; a real conversation needs 1,025 turns)."""
    import eyas.jobs.regenerate as regenerate

    monkeypatch.setattr(regenerate, "ROUNDS", 2)
    data = tmp_path / "chats.jsonl"
    turn = [{"role": "user", "content": "the falcon"}, {"role": "assistant", "content": "flies"}]
    _write(data, [turn * 2, turn * 3])
    kwargs = dict(model=str(tiny_models["llama"]), max_tokens=2, max_len=300, progress=False, kv_cache_gb=0.02,
                  temperature=1.0, seed=5)
    run_regenerate(str(data), tmp_path / "two.jsonl", max_samples=1, **kwargs)  # two replies: seeds enough
    with pytest.raises(ValueError, match="more than 2 replies"):
        run_regenerate(str(data), tmp_path / "three.jsonl", **kwargs)
