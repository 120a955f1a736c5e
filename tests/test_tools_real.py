"""Tool calling on the real default model: the official openai client against ``eyas serve`` (each tool_choice,
streamed deltas equal to the whole reply, a two-turn exchange, the Responses API, bad input), arguments valid
against their schema on real prompts, and greedy identity under n-gram, suffix and the shipped EAGLE-3 drafter
with the grammar's forced drafts accepted."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import Server

from eyas import LLM, SamplingParams

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
CALC = {"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic",
                                         "parameters": {"type": "object", "properties": {
                                             "a": {"type": "number"}, "b": {"type": "number"},
                                             "op": {"enum": ["+", "-", "*", "/"]}}, "required": ["a", "b", "op"]}}}
EVENT = {"type": "function", "function": {"name": "add_event", "description": "Add a calendar event",
                                          "parameters": {"type": "object", "properties": {
                                              "title": {"type": "string", "maxLength": 40},
                                              "day": {"type": "integer", "minimum": 1, "maximum": 31},
                                              "attendees": {"type": "array", "items": {"type": "string"},
                                                            "maxItems": 3}},
                                              "required": ["title", "day"]}}}
TOOLS = [WEATHER, CALC, EVENT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "What is 12 times 7?", "Put lunch with Ana on the 3rd in my calendar.",
           "Is it cold in Oslo right now?"]


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def server():
    with Server("smollm2", "--max-model-len", "1024", "--kv-cache-gb", "0.1", "--served-model-name", "smol") as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_each_tool_choice_through_the_openai_client(server):
    client = _client(server)
    assert server.metric("eyas:request_success_total", 'finished_reason="stop"') == 0.0  # exported at zero
    ask = dict(model="smol", messages=_messages(PROMPTS[0]), tools=TOOLS, temperature=0, max_tokens=60,
               parallel_tool_calls=False)
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "calculate"}}, "calculate")):
        reply = client.chat.completions.create(tool_choice=choice, **ask).choices[0]
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
        call = reply.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and (name is None or call.function.name == name)
        _valid(call.function.name, call.function.arguments)
        streamed = client.chat.completions.create(tool_choice=choice, stream=True, **ask)
        pieces, reason = {}, None
        for chunk in streamed:
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = pieces.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
                entry["arguments"] += delta.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls"
        assert list(pieces.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    for choice in ("auto", "none"):  # the small model answers in text here; "none" must never call
        reply = client.chat.completions.create(tool_choice=choice, **ask).choices[0]
        assert reply.message.content and not reply.message.tool_calls and reply.finish_reason in ("stop", "length")


def test_a_two_turn_exchange_with_a_tool_result(server):
    client = _client(server)
    messages = _messages(PROMPTS[0])
    first = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=60, parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=40).choices[0]
    assert second.message.content and not second.message.tool_calls
    prompt = httpx.post(server.base + "/tokenize", json={"messages": messages, "tools": TOOLS,
                                                         "return_token_strs": True}, timeout=30).json()
    text = httpx.post(server.base + "/detokenize", json={"tokens": prompt["tokens"]}, timeout=30).json()["prompt"]
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in text  # the call, verbatim
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert "calculate" in text.split("<|im_start|>user")[0]  # the tools are described before the turns


def test_the_responses_api_plain_streamed_and_with_tools(server):
    client = _client(server)
    plain = client.responses.create(model="smol", input="Say hello.", instructions="Be brief.", temperature=0,
                                    max_output_tokens=16)
    assert plain.output_text and plain.usage.output_tokens <= 16
    events = list(client.responses.create(model="smol", input="Say hello.", instructions="Be brief.",
                                          temperature=0, max_output_tokens=16, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    called = client.responses.create(model="smol", input=PROMPTS[1], tools=flat, tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    (call,) = [item for item in called.output if item.type == "function_call"]
    _valid(call.name, call.arguments)
    events = list(client.responses.create(model="smol", input=PROMPTS[1], tools=flat, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    follow = client.responses.create(model="smol", temperature=0, max_output_tokens=20, tools=flat, input=[
        {"role": "user", "content": PROMPTS[1]}, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                                  "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "84"}])
    assert follow.output_text


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools"),
    ({"tools": {"not": "a list"}}, "tools"),
    ({"tools": TOOLS, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}, "messages"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_input_gets_a_400_naming_the_field(server, body, param):
    response = httpx.post(server.base + "/v1/chat/completions", json={"messages": _messages("hi"), **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    ok = httpx.post(server.base + "/v1/chat/completions", json={"messages": _messages("hi"), "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


def test_models_by_id_and_malformed_json(server):
    assert httpx.get(server.base + "/v1/models/smol", timeout=10).json()["id"] == "smol"
    assert httpx.get(server.base + "/v1/models/other", timeout=10).status_code == 404
    bad = httpx.post(server.base + "/v1/chat/completions", content=b'{"messages": [', timeout=10,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None


def test_arguments_validate_and_speculation_is_lossless_with_forced_drafts_accepted():
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(max_num_seqs=4, max_model_len=1024)
    conversations = [_messages(p) for p in PROMPTS]
    choices = ["required", {"type": "function", "function": {"name": "add_event"}}]
    expected = {}
    for choice in choices:
        outs = plain.chat(conversations, params, use_tqdm=False, tools=TOOLS, tool_choice=choice,
                          parallel_tool_calls=False)
        for out in outs:
            (call,) = out.outputs[0].tool_calls
            _valid(call.name, call.arguments)
        expected[json.dumps(choice)] = [o.outputs[0].token_ids for o in outs]
    del plain
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
                 {"method": "suffix", "num_speculative_tokens": 4}, {"method": "eagle3"}):
        llm = LLM(max_num_seqs=4, max_model_len=1024, speculative_config=spec)
        for choice in choices:
            outs = llm.chat(conversations, params, use_tqdm=False, tools=TOOLS, tool_choice=choice,
                            parallel_tool_calls=False)
            assert [o.outputs[0].token_ids for o in outs] == expected[json.dumps(choice)], spec
        stats = llm.stats()
        assert stats["num_forced"] == stats["num_forced_accepted"] > 0, (spec, stats)
        assert stats["num_forced_accepted"] >= stats["num_accepted"] // 4, (spec, stats)


def test_seeded_tool_calls_are_identical_under_shared_noise_speculation():
    """Seeded sampling under the lazy ("auto") and the strict ("required") grammar: token-identical with
    shared-noise verification, forced drafts included."""
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=64)
    conversations = [_messages(p) for p in PROMPTS[:2]]
    ask = dict(use_tqdm=False, tools=TOOLS, parallel_tool_calls=False)
    plain = LLM(max_num_seqs=2, max_model_len=1024)
    want = {c: [o.outputs[0].token_ids for o in plain.chat(conversations, params, tool_choice=c, **ask)]
            for c in ("auto", "required")}
    del plain
    spec = LLM(max_num_seqs=2, max_model_len=1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "verification": "shared_noise"})
    for choice, tokens in want.items():
        assert [o.outputs[0].token_ids for o in spec.chat(conversations, params, tool_choice=choice, **ask)] == tokens
    stats = spec.stats()
    assert stats["num_forced"] == stats["num_forced_accepted"] > 0, stats
