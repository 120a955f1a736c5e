"""Prompt logprobs (``SamplingParams.prompt_logprobs``, and ``echo`` with ``logprobs`` on /v1/completions): each
prompt token's logprob equals what the decode path gives for that position, across prefill chunks, with the
prefix cache warm, and for n > 1; the echoed completion lists the prompt's logprobs first."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from server_helpers import Server

from eyas import LLM, SamplingParams

PROMPT = list(range(3, 40))  # 37 tokens: three prefill chunks of 16


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, kv_cache_gb=0.02,
               max_num_batched_tokens=16)


def test_each_prompt_token_matches_the_decode_path(llm):
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # warm the prefix cache
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2),
                       use_tqdm=False)[0]
    got = out.prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    for j in range(1, len(PROMPT)):
        assert PROMPT[j] in got[j] and len(got[j]) in (2, 3)  # its own, and the top 2
        assert all(lp <= 0 for lp in got[j].values())
    for j in (1, 15, 16, 17, 36):  # chunk edges included
        ref = llm.generate([PROMPT[:j]], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        assert max(got[j].items(), key=lambda kv: kv[1])[0] == ref.token_ids[0]
        for token, lp in ref.logprobs[0].items():
            assert got[j].get(token, lp) == pytest.approx(lp, abs=1e-4)
        assert math.isclose(got[j][ref.token_ids[0]], ref.logprobs[0][ref.token_ids[0]], abs_tol=1e-4)


def test_bad_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=50)


def test_echo_with_logprobs_lists_the_prompt_first(tiny_models, llm):
    with Server(tiny_models["llama"]) as server:
        body = httpx.post(server.base + "/v1/completions", json={
            "prompt": PROMPT[:10], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}, timeout=60).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 13 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and logprobs["text_offset"][0] == 0
    want = llm.generate([PROMPT[:10]], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1),
                        use_tqdm=False)[0].prompt_logprobs
    assert logprobs["token_logprobs"][1:10] == pytest.approx([e[t] for t, e in zip(PROMPT[1:10], want[1:])],
                                                             abs=1e-4)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_streamed_echo_with_logprobs_equals_the_whole_answer(tiny_models):
    """stream=true: the first chunk of each choice starts with the prompt and its logprobs (as vLLM streams them);
    the chunks joined equal the non-streamed answer: text, tokens, logprobs, top logprobs and text offsets."""
    request = {"prompt": PROMPT[:10], "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2, "n": 2}
    with Server(tiny_models["llama"]) as server:
        whole = httpx.post(server.base + "/v1/completions", json=request, timeout=60).json()
        with httpx.stream("POST", server.base + "/v1/completions", json={**request, "stream": True},
                          timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["logprobs"]["token_logprobs"][0] is None  # the prompt's first token, in the first chunk
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [v for c in mine if c["logprobs"] for v in c["logprobs"][key]]
            assert streamed == choice["logprobs"][key], key
        assert len(choice["logprobs"]["tokens"]) == 16  # 10 prompt tokens, 6 generated
