"""`eyas serve` against the official openai client and raw HTTP: outputs equal LLM.generate, 200
concurrent streams, disconnects free their blocks, OpenAI error JSON with the server still serving,
API keys, admission control, SIGTERM, and exact metrics."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

import httpx
import openai
import pytest
from server_helpers import Server, banner, wait_for

from eyas import LLM, SamplingParams
from eyas.cli import build_parser
from eyas.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from eyas.server.metrics import ServerMetrics

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_models):
    with Server(tiny_models["llama"], "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def test_sync_client_outputs_equal_offline(server, offline):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    want = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    assert chat.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert chat.choices[0].finish_reason == want.outputs[0].finish_reason

    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=2)
    want = offline.generate(["abc", "hello"], seeded, use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=["abc", "hello"], temperature=1.0, seed=7, max_tokens=12, n=2)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [c.text for o in want for c in o.outputs]
    streamed = client.completions.create(model="tiny", prompt="abc", temperature=1.0, seed=7, max_tokens=12, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == want[0].outputs[0].text


def test_stop_strings_over_the_api_equal_offline_streamed_or_not(server, offline):
    """`stop` and vLLM's `include_stop_str_in_output` reach the engine: the text ends before (or after) the stop
    string, as offline, streamed (the stream holds back what may begin a stop string) or not."""
    client = _client(server)
    text = offline.generate(["abc"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = text[6:8]
    for include in (False, True):
        want = offline.generate(["abc"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=include), use_tqdm=False)
        want = want[0].outputs[0]
        assert want.text.endswith(stop) == include and want.finish_reason == "stop"
        body = dict(model="tiny", prompt="abc", temperature=0, max_tokens=24, stop=stop,
                    extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        assert client.completions.create(**body).choices[0].text == want.text
        streamed = client.completions.create(**body, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == want.text


def test_truncate_prompt_tokens_over_the_api(server):
    """A prompt longer than the context is refused, unless vLLM's truncate_prompt_tokens keeps its last tokens."""
    body = {"model": "tiny", "prompt": "x" * 400, "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(server.base + "/v1/completions", json=body, timeout=30).status_code == 400
    got = httpx.post(server.base + "/v1/completions", json={**body, "truncate_prompt_tokens": 100}, timeout=30)
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 100
    assert got.json()["usage"]["completion_tokens"] == 3


def test_async_client_streams_chat_with_usage(server, offline):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=3, n=2,
                                                      max_tokens=9, stream=True, stream_options={"include_usage": True})
        texts, reasons, usage = ["", ""], [None, None], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        return texts, reasons, usage

    texts, reasons, usage = asyncio.run(run())
    want = offline.chat(MESSAGES, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=9), use_tqdm=False)[0]
    assert texts == [c.text for c in want.outputs]
    assert reasons == [c.finish_reason for c in want.outputs]
    assert usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)


def test_200_concurrent_streams_each_get_their_own_full_text(server, offline):
    prompts = [f"request {i} says {i * 7 % 13}" for i in range(200)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(200)]
    want = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=prompts[i], temperature=1.0, seed=i,
                                                 max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), timeout=240)

    assert asyncio.run(run()) == want


def test_a_disconnect_mid_stream_aborts_and_frees_the_blocks(server):
    aborted = server.metric("eyas:request_success_total", 'finished_reason="abort"')
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("eyas:kv_cache_usage_perc") > 0
    assert wait_for(lambda: server.metric("eyas:request_success_total", 'finished_reason="abort"') == aborted + 1)
    assert wait_for(lambda: server.metric("eyas:kv_cache_usage_perc") == 0.0)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 1000}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "x" * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": {"no": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, 400, "structured_output"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "[a-z"}, 400, "structured_output"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: nothing_here"}}, 400,
     "structured_output"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"whitespace_pattern": " "}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "a"}, 400, "guided_regex"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, path, body, status, param):
    response = httpx.post(server.base + path, json={"model": "tiny", **body} if "model" not in body else body,
                          timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_api_key_required_and_compared(tiny_models):
    with Server(tiny_models["llama"], env={"EYAS_API_KEY": "s3cret"}) as server:
        url = server.base + "/v1/models"
        assert httpx.get(url).status_code == 401
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(server.base + "/health").status_code == 200
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=str(tiny_models["llama"]), prompt="hi", max_tokens=2).choices


def test_default_bind_address_is_loopback(server):
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    line = next(line for line in server.output().splitlines() if line.startswith("eyas serve:"))
    assert banner(line) == {"url": f"http://127.0.0.1:{server.port}", "model": "tiny",
                                                    "speculation": "none"}


def test_past_max_waiting_the_server_answers_503_with_retry_after(tiny_models):
    with Server(tiny_models["llama"], "--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "1024",
                "--kv-cache-gb", "0.1") as server:
        long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=long, timeout=60) as first:
            running = first.iter_lines()  # kept: a dropped iterator closes the stream
            next(running)
            with httpx.stream("POST", server.base + "/v1/completions", json=long, timeout=60):
                assert wait_for(lambda: server.metric("eyas:num_requests_waiting") == 1)
                busy = httpx.post(server.base + "/v1/completions", json={"prompt": "y"}, timeout=30)
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
                assert busy.json()["error"]["code"] == "overloaded"


def test_sigterm_with_a_stream_in_flight_exits_0(tiny_models):
    with Server(tiny_models["llama"], "--max-model-len", "1024", "--kv-cache-gb", "0.1") as server:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream ends: finished, or aborted at the grace deadline
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert server.proc.wait(timeout=60) == 0


def test_speculative_server_is_lossless_and_reports_per_request_figures(tiny_models, offline):
    spec = ["--spec-method", "ngram", "--spec-tokens", "3", "--spec-lookup-min", "1", "--per-request-spec-metrics"]
    prompt = "abcabcabcabcabcabc"
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    with Server(tiny_models["llama"], *spec) as server:
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True}
        got = httpx.post(server.base + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want[0].outputs[0].text
        figures = got["spec_decode_metrics"][0]
        assert figures["num_drafts"] > 0
        assert server.metric("eyas:spec_decode_num_drafts_total") == figures["num_drafts"]
        assert server.metric("eyas:spec_decode_num_draft_tokens_total") == figures["num_draft_tokens"]
        assert server.metric("eyas:spec_decode_num_accepted_tokens_total") == figures["num_accepted_tokens"]
        for i, accepted in enumerate(figures["num_accepted_tokens_per_pos"]):
            assert server.metric("eyas:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"') == accepted
        stream = {**body, "stream": True, "return_token_sources": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=stream, timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        sources = [s for c in chunks for s in c["choices"][0].get("token_sources", [])]
        assert "".join(s["text"] for s in sources) == want[0].outputs[0].text
        assert any(s["draft"] for s in sources) and not all(s["draft"] for s in sources)
        # a stop string inside a verified run ends the output where decoding a token a step ends it
        stop = want[0].outputs[0].text[10:12]
        plain = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop),
                                 use_tqdm=False)[0].outputs[0]
        got = httpx.post(server.base + "/v1/completions", json={**body, "stop": stop}, timeout=60).json()
        assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (plain.text, "stop")
        assert got["usage"]["completion_tokens"] == len(plain.token_ids) < 40
        assert got["spec_decode_metrics"][0]["num_accepted_tokens"] > 0


def _output(request_id, reason, tokens, prompt=3, arrival=0.0, first=0.5, finish=2.5):
    finished = reason is not None
    return RequestOutput(request_id, None, list(range(prompt)), [CompletionOutput(0, "", list(range(tokens)), reason)],
                         finished, RequestMetrics(arrival, first, finish if finished else None, tokens))


def test_metrics_are_exact_on_a_constructed_case():
    from types import SimpleNamespace

    m = ServerMetrics("m")
    m.observe_step([_output("a", None, 2)], {"num_steps": 1, "num_drafted": 3, "num_accepted": 2,
                                             "accepted_per_position": [1, 1, 0]})
    m.observe_step([_output("a", "stop", 5), _output("b", "length", 1, prompt=4)],
                   {"num_steps": 2, "num_drafted": 6, "num_accepted": 2, "accepted_per_position": [1, 1, 0]})
    text = m.render(SimpleNamespace(num_running=2, num_waiting=1, kv_usage=0.25, num_preemptions=3)).decode()

    def value(sample: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(sample))
        return float(line.rsplit(" ", 1)[1])

    assert value('eyas:spec_decode_num_drafts_total{model_name="m"}') == 2
    assert value('eyas:spec_decode_num_draft_tokens_total{model_name="m"}') == 6
    assert value('eyas:spec_decode_num_accepted_tokens_total{model_name="m"}') == 2
    assert value('eyas:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}') == 1
    assert value('eyas:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}') == 0
    assert value('eyas:prompt_tokens_total{model_name="m"}') == 7
    assert value('eyas:generation_tokens_total{model_name="m"}') == 6
    assert value('eyas:request_success_total{finished_reason="stop",model_name="m"}') == 1
    assert value('eyas:request_success_total{finished_reason="length",model_name="m"}') == 1
    assert value('eyas:num_requests_running{model_name="m"}') == 2
    assert value('eyas:num_requests_waiting{model_name="m"}') == 1
    assert value('eyas:kv_cache_usage_perc{model_name="m"}') == 0.25
    assert value('eyas:num_preemptions_total{model_name="m"}') == 3
    assert value('eyas:time_to_first_token_seconds_count{model_name="m"}') == 2
    assert value('eyas:time_to_first_token_seconds_sum{model_name="m"}') == 1.0
    assert value('eyas:e2e_request_latency_seconds_sum{model_name="m"}') == 5.0
    assert value('eyas:time_per_output_token_seconds_sum{model_name="m"}') == 0.5  # (2.5 - 0.5) / 4; b has 1 token


def test_the_playground_page_is_served(server):
    with urllib.request.urlopen(server.base + "/", timeout=10) as r:
        page = r.read().decode()
    assert "return_token_sources" in page and "/v1/chat/completions" in page and "accepted draft" in page


def test_logprobs_equal_offline(server, offline):
    client = _client(server)
    want = offline.generate(["abc"], SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=5, logprobs=2).choices[0]
    sampled = [entry[t] for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert got.logprobs.token_logprobs == pytest.approx(sampled, abs=1e-5)
    assert all(len(top) >= 1 for top in got.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True,
                                          top_logprobs=3).choices[0]
    assert len(chat.logprobs.content) == 4 and all(len(t.top_logprobs) == 3 for t in chat.logprobs.content)
    assert all(t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob for t in chat.logprobs.content)


def test_structured_output_fields_equal_offline_structured_output(server, offline):
    """response_format (json_object, json_schema), structured_outputs and guided_* reach the engine as
    SamplingParams.structured_output: the same text as offline, and valid."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    client = _client(server)
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}},
              {"json": schema}),
             ({"response_format": {"type": "json_object"}}, {"json_object": True}),
             ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, {"choice": ["yes", "no"]}),
             ({"extra_body": {"guided_regex": "[0-9]{3}"}}, {"regex": "[0-9]{3}"})]
    for fields, structured in cases:
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=60, **fields)
        want = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=60, structured_output=structured),
                            use_tqdm=False)[0].outputs[0]
        assert chat.choices[0].message.content == want.text
        # the tiny model's json_object reply runs to max_tokens; the budget-aware close ends it complete in time
        assert chat.choices[0].finish_reason == want.finish_reason == "stop"
        if "json_object" in structured:
            assert isinstance(json.loads(chat.choices[0].message.content), dict)
    jsonschema.validate(json.loads(client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=60, response_format=cases[0][0]["response_format"]
    ).choices[0].message.content), schema)
    got = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=20,
                                    extra_body={"guided_choice": ["left", "right"]})
    assert got.choices[0].text in ("left", "right")


def test_labelled_counters_are_exported_at_zero_from_the_start():
    from types import SimpleNamespace

    text = ServerMetrics("m").render(SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0,
                                                     num_preemptions=0)).decode()
    for reason in ("stop", "length", "abort"):
        assert f'eyas:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text
    assert 'eyas:spec_decode_num_accepted_tokens_total{model_name="m"} 0.0' in text
    assert 'eyas:time_to_first_token_seconds_count{model_name="m"} 0.0' in text


def test_token_sources_leave_out_the_stop_token():
    """The stop token is not content: a chunk's token_sources list what its text holds (the playground's colours)."""
    from eyas.model.resolve import resolve_model
    from eyas.model.tokenizer import Tokenizer
    from eyas.server.responses import Formatter

    tok = Tokenizer.from_folder(resolve_model(None))
    ids = tok.encode("Hi there", add_special_tokens=False)
    fmt = Formatter(tok, "m", "id", chat=True, spec_metrics=False)
    ended = CompletionOutput(0, "Hi there", ids + [2], "stop", 2, from_draft=[False, True, True])
    sources = fmt.chunk(0, {"content": "Hi there"}, "stop", sources=(ended, 0))["choices"][0]["token_sources"]
    assert "".join(s["text"] for s in sources) == "Hi there" and [s["draft"] for s in sources] == [False, True]
    cut = CompletionOutput(0, "Hi there", ids, "length", None, from_draft=[False, True])
    assert len(fmt.chunk(0, {}, "length", sources=(cut, 0))["choices"][0]["token_sources"]) == len(ids)


def test_a_client_that_times_out_leaves_no_traceback_in_the_log(tiny_models):
    # 1,000 tokens: the tiny model made 240 in under 0.3 s on a Zen 4 host
    server = Server(tiny_models["llama"], "--max-model-len", "1024")
    with server:
        for _ in range(3):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 1000,
                                                                  "ignore_eos": True}, timeout=0.3)
        ok = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    log = server.output()
    assert "never retrieved" not in log and "Traceback" not in log, log
