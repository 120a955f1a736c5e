"""Call syntaxes whose markers the tokenizer holds as one *special* token (Mistral v3's ``[TOOL_CALLS]``; some
Hermes tokenizers' ``<tool_call>`` and ``</tool_call>``), on a copy of the tiny byte-level tokenizer with those texts
added as special tokens. The grammar names the token (llguidance's ``<[id]>``) in "required", named and "auto"
grammars and refuses the text spelled in plain pieces; the reply's text keeps the token for the parser while the
content never shows it; on a tiny random model a reply is the special token and a schema-valid call, token for
token the same with n-gram drafts, which draft through the special tokens, and served whole and streamed alike."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from server_helpers import Server
from test_tool_syntaxes import HERMES_TEMPLATE, MISTRAL_TEMPLATE, SEARCH, WEATHER
from tokenizers import Tokenizer as Backend

from eyas import LLM, SamplingParams
from eyas.model.detokenizer import IncrementalDetokenizer
from eyas.model.resolve import resolve_model
from eyas.model.tokenizer import Tokenizer
from eyas.sampling.grammar import GrammarCompiler
from eyas.server.tool_stream import ReplyDeltas
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import constrain, tool_grammar
from eyas.tools.hermes import HERMES
from eyas.tools.mistral import MISTRAL

SPECIALS = {"mistral": (["[TOOL_CALLS]"], MISTRAL_TEMPLATE), "hermes": (["<tool_call>", "</tool_call>"], HERMES_TEMPLATE)}
ARGS = {"city": "Oslo", "unit": "celsius"}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def special_models(tiny_models, tmp_path_factory) -> dict:
    """name -> a copy of the tiny llama whose tokenizer holds the syntax's markers as added special tokens (ids 259
    and up, inside the model's 320 logits) and whose chat template writes the syntax."""
    root, out = tmp_path_factory.mktemp("special"), {}
    for name, (texts, template) in SPECIALS.items():
        folder = root / name
        shutil.copytree(tiny_models["llama"], folder)
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        assert backend.add_special_tokens(texts) == len(texts)
        backend.save(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        out[name] = folder
    return out


def _parts(folder) -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = Tokenizer.from_folder(folder)
    return tokenizer, GrammarCompiler(tokenizer.backend.to_str, 320, sorted(tokenizer.eos_token_ids))


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` in byte tokens only: the markers spelled in plain pieces (encoding splits them out otherwise)."""
    return [t for character in text for t in tokenizer.encode(character, add_special_tokens=False)]


def test_bind_finds_the_markers_the_tokenizer_holds_as_special_tokens(tiny_models, special_models):
    mistral, _ = _parts(special_models["mistral"])
    hermes, _ = _parts(special_models["hermes"])
    bound = ToolRequest.from_openai([WEATHER], "required", tokenizer=mistral).syntax
    assert bound.special == (("[TOOL_CALLS]", 259),) and bound.trigger_token == 259 and bound.special_ids == (259,)
    assert bound.pieces("[TOOL_CALLS] [") == [259, " ["] and bound.native_id("call_0") == MISTRAL.native_id("call_0")
    both = ToolRequest.from_openai([WEATHER], "required", tokenizer=hermes).syntax
    assert dict(both.special) == {"<tool_call>": 259, "</tool_call>": 260} and both.trigger_token == 259
    assert HERMES.bind(mistral) is HERMES  # no marker of Hermes's is special there
    assert MISTRAL.bind(hermes) is MISTRAL
    default = Tokenizer.from_folder(resolve_model(None))
    assert HERMES.bind(default) is HERMES  # SmolLM2 writes <tool_call> as text: today's grammar, unchanged
    backend = Backend.from_file(str(tiny_models["llama"] / "tokenizer.json"))
    backend.add_tokens(["[TOOL_CALLS]"])  # one added token, but not a special one (as Qwen holds <tool_call>)
    ordinary = Tokenizer(backend)
    assert ordinary.encode("[TOOL_CALLS]", add_special_tokens=False) == [259] and MISTRAL.bind(ordinary) is MISTRAL


@pytest.mark.parametrize("name", SPECIALS)
def test_the_grammar_names_the_special_token_and_refuses_its_spelling(special_models, name):
    tokenizer, compiler = _parts(special_models[name])
    syntax = {"mistral": MISTRAL, "hermes": HERMES}[name]
    ids = dict(syntax.bind(tokenizer).special)

    def state(choice):
        request = ToolRequest.from_openai([WEATHER, SEARCH], choice, tokenizer=tokenizer)
        return compiler.state(compiler.compile({"grammar": tool_grammar(request)}), 10**6)

    def accepts(choice, tokens: list[int]) -> bool:
        matcher = state(choice).matcher
        return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()

    def encode(text: str) -> list[int]:  # the markers as their special tokens
        return tokenizer.encode(text, add_special_tokens=False)

    one = syntax.calls_text([("get_weather", ARGS)])
    two = syntax.calls_text([("get_weather", ARGS), ("search", {"query": "umbrella"})])
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert all(t in encode(one) for t in ids.values())
    for choice in ("required", named):
        first = state(choice)
        assert first.only_token() == ids[syntax.trigger]  # the special token is forced, so drafted
        assert accepts(choice, encode(one)) and not accepts(choice, _plain(tokenizer, one))
    assert accepts("required", encode(two)) and not accepts(named, encode(two))
    assert not accepts("required", encode(one.replace("celsius", "kelvin")))
    # "auto": free text stays free until the special token, but never spells the trigger (the parser's) in pieces
    assert accepts("auto", _plain(tokenizer, f"Say {syntax.trigger[:-1]}, {syntax.trigger[1:]} or {one[-12:]}."))
    assert not accepts("auto", _plain(tokenizer, f"Say {one} to call."))
    assert accepts("auto", encode("Let me look. ") + encode(one))
    matcher = state("auto").matcher
    assert matcher.consume_tokens(encode("Let me look. ") + [ids[syntax.trigger]])
    forced = syntax.opening[len(syntax.trigger):] + '{"name": "'
    assert matcher.compute_ff_bytes() == forced.encode()  # from the trigger on, the call is constrained
    assert not accepts("auto", encode("Let me look. ") + encode(one.replace("celsius", "kelvin")))
    trigger = ids[syntax.trigger]
    assert state("auto").bitmask()[trigger >> 5] >> (trigger & 31) & 1  # the call may start at the first token


@pytest.mark.parametrize("name", SPECIALS)
def test_the_reply_keeps_the_special_tokens_for_the_parser_whole_and_streamed(special_models, name):
    tokenizer, _ = _parts(special_models[name])
    request = ToolRequest.from_openai([WEATHER, SEARCH], "auto", tokenizer=tokenizer)
    syntax = request.syntax
    text = "Checking. " + syntax.calls_text([("get_weather", ARGS), ("search", {"query": "a ]} \"x\""})])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) != text  # skip_special_tokens alone drops the markers: the parser would find none
    kept = constrain(SamplingParams(), request).keep_special_token_ids
    assert kept == syntax.special_ids and tokenizer.decode(ids, keep=kept) == text
    whole = parse_reply(tokenizer.decode(ids, keep=kept), syntax)
    assert whole.content == "Checking. " and [c.name for c in whole.calls] == ["get_weather", "search"]
    assert json.loads(whole.calls[0].arguments) == ARGS
    detokenizer, deltas, streamed, calls = IncrementalDetokenizer(tokenizer, True, kept), ReplyDeltas(request), "", {}
    for i, token in enumerate(ids):
        streamed += detokenizer.add(token)
        delta = deltas.update(streamed, i == len(ids) - 1)
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
        assert syntax.trigger not in delta.get("content", "")
    assert streamed == text and deltas.content_sent == len("Checking. ")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]
    cut = tokenizer.decode(ids[:len(tokenizer.encode("Checking. ", add_special_tokens=False)) + 6], keep=kept)
    assert syntax.trigger in cut and parse_reply(cut, syntax).calls == []
    assert syntax.trigger not in parse_reply(cut, syntax).content  # a call cut short: its text, less the markers


@pytest.mark.parametrize("name", SPECIALS)
def test_a_tiny_model_writes_the_special_token_and_a_valid_call(special_models, name):
    """LLM.chat: under "required" each reply starts with the special token and parses to a call that validates;
    under "auto", with the special token made likely, the free text ends there and the call that follows is valid.
    Token for token the same with n-gram drafts, which draft the forced tokens after the special token (for
    Hermes the special ``</tool_call>`` itself)."""
    outs, autos, llms = {}, {}, {}
    conversations = [[{"role": "user", "content": f"Weather {i}?"}] for i in range(2)]
    tokenizer = Tokenizer.from_folder(special_models[name])
    syntax = ToolRequest.from_openai([WEATHER], tokenizer=tokenizer).syntax
    for spec in (None, NGRAM):
        llms[spec is None] = llm = LLM(str(special_models[name]), dtype="float32", max_model_len=1024,
                                       kv_cache_gb=0.05, speculative_config=spec)
        outs[spec is None] = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=120),
                                      tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False,
                                      use_tqdm=False)
        autos[spec is None] = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=60, logit_bias={
            syntax.trigger_token: 30}), tools=[WEATHER, SEARCH], parallel_tool_calls=False, use_tqdm=False)
    drafted_special = 0
    for out, plain in zip(outs[False] + autos[False], outs[True] + autos[True]):
        completion = out.outputs[0]
        assert completion.token_ids == plain.outputs[0].token_ids and completion.text == plain.outputs[0].text
        assert completion.token_ids[0] == syntax.trigger_token and completion.text.startswith(syntax.opening)
        call, = completion.tool_calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        drafted_special += sum(d for t, d in zip(completion.token_ids, completion.from_draft) if t in syntax.special_ids)
    assert llms[False].stats()["num_forced_accepted"] > 0
    if name == "hermes":
        assert drafted_special > 0  # the special </tool_call> itself came as an accepted forced draft


def test_the_server_answers_with_tool_calls_whole_and_streamed(special_models):
    """``eyas serve`` on the Mistral-style tokenizer: "required" and "auto" replies carry ``message.tool_calls`` and
    ``finish_reason: "tool_calls"``, never ``[TOOL_CALLS]`` in the content; the streamed deltas join into the
    whole call."""
    client_module = pytest.importorskip("openai")
    with Server(special_models["mistral"], "--max-model-len", "1024", "--served-model-name", "tiny") as server:
        client = client_module.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, SEARCH],
                   temperature=0, max_tokens=80, parallel_tool_calls=False)
        for extra in ({"tool_choice": "required"}, {"tool_choice": "auto", "logit_bias": {"259": 30}}):
            reply = client.chat.completions.create(**ask, **extra).choices[0]
            assert reply.finish_reason == "tool_calls" and reply.message.content is None
            (call,) = reply.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            pieces, content, reason = {}, "", None
            for chunk in client.chat.completions.create(**ask, **extra, stream=True):
                content += chunk.choices[0].delta.content or ""
                for delta in chunk.choices[0].delta.tool_calls or []:
                    entry = pieces.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
                    entry["arguments"] += delta.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
            assert reason == "tool_calls" and content == ""
            assert list(pieces.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
