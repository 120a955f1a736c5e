"""Template-native tool-call syntaxes: Llama 3.x JSON and Mistral [TOOL_CALLS] beside Hermes. Each is detected from
a chat template written here the way that family's templates are (tools handed to the template, past calls and
results written back in the family's own way), constrained in the model's own call syntax, and parsed back,
whole and streamed; on a tiny model a constrained reply parses to a schema-valid call, the same with drafts."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from eyas import LLM, SamplingParams
from eyas.model.resolve import resolve_model
from eyas.model.tokenizer import Tokenizer
from eyas.sampling.grammar import GrammarCompiler
from eyas.server.tool_stream import ReplyDeltas
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import tool_grammar
from eyas.tools.hermes import HERMES
from eyas.tools.llama3_json import LLAMA3_JSON
from eyas.tools.mistral import MISTRAL
from eyas.tools.render import render_chat
from eyas.tools.syntaxes import for_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"]}}}

# Llama 3.1 style: tools in the first user message, a past call as {"name", "parameters"}, a result as ipython
LLAMA = """{{- bos_token }}{%- set tools = tools if tools is defined else none %}
{%- for m in messages %}
{%- if m.role == 'user' and loop.first and tools is not none %}<|start_header_id|>user<|end_header_id|>

Answer with a function call. Respond in the format {"name": function name, "parameters": dictionary of \
argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{{ m.content }}<|eot_id|>
{%- elif m.tool_calls is defined %}
{%- if m.tool_calls | length != 1 %}{{ raise_exception("one tool call per message") }}{% endif %}
<|start_header_id|>assistant<|end_header_id|>

{{ '{"name": "' + m.tool_calls[0].function.name + '", "parameters": ' + m.tool_calls[0].function.arguments | tojson \
+ '}' }}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ {"output": m.content} | tojson }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral v0.3 style: [AVAILABLE_TOOLS] before the last user turn, past calls with 9-character ids
MISTRAL_TEMPLATE = """{{- bos_token }}{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools is defined and m == users[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST] {{ m.content }}[/INST]
{%- elif m.tool_calls is defined %}[TOOL_CALLS] [
{%- for c in m.tool_calls %}
{%- if c.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9") }}\
{% endif %}
{{- '{"name": "' + c.function.name + '", "arguments": ' + c.function.arguments | tojson + ', "id": "' + c.id + '"}' }}
{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {"content": {{ m.content }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %} {{ m.content }}{{ eos_token }}
{%- endif %}{%- endfor %}"""

HERMES_TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
           {"role": "user", "content": "And in Oslo?"}]
SYNTAXES = {"hermes": (HERMES, HERMES_TEMPLATE), "llama3_json": (LLAMA3_JSON, LLAMA),
            "mistral": (MISTRAL, MISTRAL_TEMPLATE)}
ARGS = {"city": "Oslo", "unit": "celsius"}


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(Backend(WordLevel({"a": 0}, unk_token="a")), chat_template=template, eos_token="</s>")


@pytest.fixture(scope="module")
def compiler() -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = Tokenizer.from_folder(resolve_model(None))
    return tokenizer, GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size,
                                      sorted(tokenizer.eos_token_ids))


def test_each_template_gets_its_own_syntax_and_others_the_generic_one():
    for syntax, template in SYNTAXES.values():
        assert for_template(template) == (syntax, True)
    default = Tokenizer.from_folder(resolve_model(None)).chat_template  # SmolLM2's knows no tools
    assert for_template(default) == (HERMES, False) and for_template(None) == (HERMES, False)


def test_history_is_rendered_by_the_template_in_its_own_syntax():
    tools = [WEATHER]
    llama = render_chat(_tokenizer(LLAMA), HISTORY, ToolRequest.from_openai(tools, tokenizer=_tokenizer(LLAMA)))
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>' in llama
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "{\\"temp\\": 21}"}' in llama
    assert '"name": "get_weather", "description": "Weather now"' in llama  # the tools, by the template
    assert llama.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")

    mistral = render_chat(_tokenizer(MISTRAL_TEMPLATE), HISTORY,
                          ToolRequest.from_openai(tools, tokenizer=_tokenizer(MISTRAL_TEMPLATE)), add_generation_prompt=False)
    call_id = MISTRAL.native_id("c1")
    assert len(call_id) == 9 and call_id.isalnum()
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
            f'"id": "{call_id}"}}]</s>[TOOL_RESULTS] {{"content": {{"temp": 21}}, "call_id": "{call_id}"}}') in mistral
    assert mistral.index("[AVAILABLE_TOOLS]") > mistral.index("[TOOL_RESULTS]")  # before the last user turn
    assert MISTRAL.native_id("call_Ab12Cd34Ef") == "call_Ab12Cd34Ef"  # an OpenAI id already fits


@pytest.mark.parametrize("name", SYNTAXES)
def test_the_grammar_speaks_the_models_own_syntax(compiler, name):
    tokenizer, grammars = compiler
    syntax, template = SYNTAXES[name]

    def accepts(request: ToolRequest, text: str) -> bool:
        state = grammars.state(grammars.compile({"grammar": tool_grammar(request)}), 10**6)
        ok = all(state.matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok and state.matcher.is_accepting()

    one = syntax.calls_text([("get_weather", ARGS)])
    two = syntax.calls_text([("get_weather", ARGS), ("search", {"query": "umbrella"})])
    required = ToolRequest.from_openai([WEATHER, SEARCH], "required", tokenizer=_tokenizer(template))
    auto = ToolRequest.from_openai([WEATHER, SEARCH], "auto", False, tokenizer=_tokenizer(template))
    assert required.syntax is syntax
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, "Sure. " + one)  # calls from the first token
    assert accepts(auto, "Plain text.") and accepts(auto, "Let me look. " + one)
    assert not accepts(auto, two)  # not parallel
    assert not accepts(required, one.replace("celsius", "kelvin"))  # the schema holds
    other = {"hermes": MISTRAL, "llama3_json": HERMES, "mistral": LLAMA3_JSON}[name]
    assert not accepts(required, other.calls_text([("get_weather", ARGS)]))  # another family's syntax is refused
    if syntax is LLAMA3_JSON:
        assert one == '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    if syntax is MISTRAL:
        assert two.startswith('[TOOL_CALLS] [{"name": "get_weather", "arguments": ') and two.endswith("}}]")


@pytest.mark.parametrize("name", SYNTAXES)
def test_calls_parse_back_whole_and_streamed(name):
    syntax, template = SYNTAXES[name]
    tricky = {"query": 'a "}]; {\\"name\\"'}  # the syntax's own punctuation inside a value
    text = "Checking. " + syntax.calls_text([("get_weather", ARGS), ("search", tricky)])
    whole = parse_reply(text, syntax)
    assert whole.content == "Checking. " and [c.name for c in whole.calls] == ["get_weather", "search"]
    assert [json.loads(c.arguments) for c in whole.calls] == [ARGS, tricky]
    assert parse_reply(text[:-5], syntax).calls == whole.calls[:1]  # cut by max_tokens: the whole calls only
    request = ToolRequest.from_openai([WEATHER, SEARCH], tokenizer=_tokenizer(template))
    for step in (1, 4):
        deltas, content, calls = ReplyDeltas(request), "", {}
        for end in [*range(0, len(text), step), len(text)]:
            delta = deltas.update(text[:end], end == len(text))
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
                entry["arguments"] += call["function"]["arguments"]
        assert content == whole.content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]


@pytest.mark.parametrize("name", ["llama3_json", "mistral"])
def test_a_tiny_model_calls_in_its_templates_syntax(tiny_models, name):
    """LLM.chat on a tiny random model whose template is one of the families': "required" replies parse to
    calls that validate against their schemas, token for token the same with n-gram drafts (forced ones)."""
    syntax, template = SYNTAXES[name]
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}):
        llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=1024, kv_cache_gb=0.05,
                  speculative_config=spec)
        llm.tokenizer = copy.copy(llm.tokenizer)
        llm.tokenizer.chat_template = template
        conversations = [[{"role": "user", "content": f"Weather {i}?"}] for i in range(4)]
        outs[spec is None] = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=120), tools=[
            WEATHER, SEARCH], tool_choice="required", use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    for out, plain in zip(outs[False], outs[True]):
        completion = out.outputs[0]
        assert completion.token_ids == plain.outputs[0].token_ids
        assert completion.text.startswith(syntax.opening) and completion.tool_calls
        for call in completion.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
