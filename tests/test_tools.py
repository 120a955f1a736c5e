"""Tool calling without a model: requests refused with the field named, the grammar's verdicts on text
(lazy trigger, closed objects, named functions), calls parsed back whole and from every streamed prefix,
and tool history rendered natively or in the generic format; the tokenizer's exact token bytes."""

from __future__ import annotations

import json
import re

import pytest

from eyas.model.resolve import resolve_model
from eyas.model.tokenizer import Tokenizer
from eyas.sampling.grammar import GrammarCompiler
from eyas.server.tool_stream import ReplyDeltas
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import closed, tool_grammar
from eyas.tools.hermes import HERMES
from eyas.tools.render import render_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))


@pytest.mark.parametrize("tools, choice, field", [
    ({"a": 1}, None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}], None,
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([], "required", "tools"),
])
def test_bad_tool_requests_name_their_field(tools, choice, field):
    with pytest.raises(ValueError) as error:
        ToolRequest.from_openai(tools, choice)
    assert str(error.value).startswith(field + ":") or str(error.value).startswith(field + "."), error.value


def _accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    state = compiler.state(compiler.compile({"grammar": grammar}), 10**6)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not state.matcher.consume_token(token):
            return False
    return state.matcher.is_accepting()


def test_the_grammar_is_lazy_for_auto_and_strict_once_triggered(compiler, tokenizer):
    auto = tool_grammar(ToolRequest.from_openai([WEATHER, SEARCH], "auto", False))
    assert _accepts(compiler, tokenizer, auto, "Just text, no call. {\"name\": x")
    assert _accepts(compiler, tokenizer, auto, "Let me look." + CALL)
    assert not _accepts(compiler, tokenizer, auto, "Let me look.<tool_call>\n{\"name\": \"get_time\"")
    assert not _accepts(compiler, tokenizer, auto, CALL.replace('"celsius"', '"kelvin"'))  # enum
    assert not _accepts(compiler, tokenizer, auto, CALL.replace('}}', ', "extra": 1}}'))  # closed object
    assert not _accepts(compiler, tokenizer, auto, CALL + "\n" + CALL)  # not parallel
    required = tool_grammar(ToolRequest.from_openai([WEATHER, SEARCH], "required"))
    assert not _accepts(compiler, tokenizer, required, "Sure." + CALL)  # calls from the first token
    assert _accepts(compiler, tokenizer, required, CALL + "\n" + CALL)  # parallel by default
    named = tool_grammar(ToolRequest.from_openai([WEATHER, SEARCH], {"type": "function", "function": {
        "name": "search"}}))
    assert not _accepts(compiler, tokenizer, named, CALL)
    assert _accepts(compiler, tokenizer, named, '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n'
                                                '</tool_call>')
    assert tool_grammar(ToolRequest.from_openai([WEATHER], "none")) is None


def test_closed_adds_no_keys_to_property_maps():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "enum": {"enum": [{"properties": {}}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "enum"}  # names, not schemas, are left alone
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["enum"]["enum"] == [{"properties": {}}]  # values are not schemas


def test_streamed_deltas_joined_equal_the_whole_reply():
    text = "Checking." + CALL + "\n" + CALL.replace("Paris", "Oslo \\\"Norway\\\"")
    whole = parse_reply(text, HERMES)
    assert whole.content == "Checking." and [c.name for c in whole.calls] == ["get_weather"] * 2
    assert json.loads(whole.calls[1].arguments) == {"city": 'Oslo "Norway"', "unit": "celsius"}
    for step in (1, 3, 7):  # every prefix, in pieces of a few characters
        deltas, content, calls = ReplyDeltas(ToolRequest.from_openai([WEATHER])), "", {}
        for end in [*range(0, len(text), step), len(text)]:
            delta = deltas.update(text[:end], end == len(text))
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
                assert ("id" in call) == (entry["arguments"] == "" and "name" in call["function"])
                entry["arguments"] += call["function"]["arguments"]
        assert content == whole.content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]
        assert deltas.finish_reason("stop") == "tool_calls"


def test_a_reply_cut_short_keeps_its_whole_calls_only():
    assert parse_reply(CALL[:-5], HERMES).calls == [] and parse_reply(CALL[:-5], HERMES).content == CALL[:-5]
    cut = parse_reply(CALL + "\n<tool_call>\n{\"name\": \"get_weather\", \"argu", HERMES)
    assert [c.name for c in cut.calls] == ["get_weather"] and cut.content == ""


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]


def test_generic_rendering_keeps_the_calls_and_results(tokenizer):
    text = render_chat(tokenizer, HISTORY, ToolRequest.from_openai([WEATHER]))
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system message
    assert CALL in text  # the call, as the grammar writes it
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_native_rendering_hands_the_template_tools_and_call_objects():
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
                "{{ c.function.arguments.city }}</tool_call>{% endfor %}{% if m.tool_call_id %}"
                "@{{ m.tool_call_id }}{% endif %}{% endfor %}")
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    tok = Tokenizer(Backend(WordLevel({"a": 0}, unk_token="a")), chat_template=template)
    text = render_chat(tok, HISTORY, ToolRequest.from_openai([WEATHER]), add_generation_prompt=False)
    assert text == ("[tool get_weather]<user>Weather in Paris?<assistant><tool_call>get_weatherParis</tool_call>"
                    '<tool>{"temp": 21}@c1')


def test_chat_template_kwargs_reach_the_template_and_its_own_variables_are_refused():
    """vLLM's chat_template_kwargs: Qwen3's ``enable_thinking`` shape reaches the template; a variable eyas sets
    (``tools``, ``messages``...) or a value that is not an object is refused by name."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>"
                "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}")
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    tok = Tokenizer(Backend(WordLevel({"a": 0}, unk_token="a")), chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, messages) == "<user>hi<assistant>"
    assert render_chat(tok, messages, template_kwargs={"enable_thinking": False}) == "<user>hi<assistant><think></think>"
    for bad in ({"tools": []}, {"messages": [], "x": 1}, ["enable_thinking"]):
        with pytest.raises(ValueError, match=r"^chat_template_kwargs: must be an object of template variables"):
            render_chat(tok, messages, template_kwargs=bad)


def test_llm_chat_hands_chat_template_kwargs_to_the_template(tiny_models):
    from eyas import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ greeting | default('') }}"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template_kwargs={"greeting": " there"})[0]
    assert out.prompt == "hi there"


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y", "tool_call_id": "zz"}],
     "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"type": "code_interpreter"}]}], "messages[0].tool_calls[0]"),
    ([{"role": "user", "content": "x", "tool_calls": []}], None),
])
def test_unsupported_history_is_refused_by_name(tokenizer, messages, field):
    if field is None:  # an empty list of calls on a user message is harmless
        render_chat(tokenizer, messages)
        return
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        render_chat(tokenizer, messages)


def test_continue_final_message_ends_the_prompt_inside_the_reply(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    text = render_chat(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(ValueError, match="^continue_final_message"):
        render_chat(tokenizer, messages, add_generation_prompt=True, continue_final_message=True)


def test_token_bytes_are_exact_for_parts_of_a_character(tokenizer):
    text = "héllo 😀 naïve 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any(_partial(p) for p in pieces)  # the emoji is split across tokens: some piece is not UTF-8 alone
    assert tokenizer.token_bytes(2) == b"<|im_end|>"


def _partial(piece: bytes) -> bool:
    try:
        piece.decode()
        return False
    except UnicodeDecodeError:
        return True
