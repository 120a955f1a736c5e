"""The grammar that makes a reply's tool calls valid by construction (llguidance's Lark dialect), in the
request's call syntax (``eyas.tools.syntax``).

* ``"required"`` or a named function: the reply is calls only, from its first token;
* ``"auto"``: a *lazy* grammar: free text, unconstrained, until the text holds the syntax's trigger
  (a lazy lexeme ends at the first match of its trigger); from there the rest is calls. A trigger the
  tokenizer holds as one special token ends the free text by itself (text never holds a special token), and the
  free text may not spell it in plain pieces, so that the trigger the parser finds is always the token;
* ``"none"``: no grammar.

Each call is ``{"name": "<one of the callable tools>", "<arguments key>": <that tool's schema>}`` with JSON's
fixed separators (``eyas.sampling.grammar.JSON_FORMAT``), between the syntax's opening, suffix, separator and
closing; ``parallel_tool_calls`` lets more calls follow. Everything but the argument values is forced once
the name is chosen: the wrapper, the keys, the punctuation, a single-choice enum. The engine drafts those
tokens for free under every drafter (``eyas.spec_decode.grammar_drafts``). Objects that list their
``properties`` take no other keys (``closed``).

A piece of those texts that the tokenizer holds as one special token (``CallSyntax.bind``) is named by its id
(llguidance's ``<[id]>``), so the model writes the one token it was trained on, never its text in plain pieces:
Mistral's "required" grammar on a v3 tokenizer (``[TOOL_CALLS]`` is token 5) starts
``start: <[5]> " [{\\"name\\": \\"" calls``.

Example (auto, Hermes's syntax, one tool ``f`` with an integer ``x``, not parallel)::

    %llguidance {}
    start: free | lead "\\n{\\"name\\": \\"" calls
    free: TEXT
    TEXT: /(.|\\n)*/
    lead[lazy]: TEXT "<tool_call>"
    calls: call
    call: call_0
    call_0: "f\\", \\"arguments\\": " args_0 "}\\n</tool_call>"
    args_0: %json {"type": "object", "properties": {"x": {"type": "integer"}}, "x-guidance": {...}}
"""

from __future__ import annotations

import dataclasses
import json

from eyas.sampling.grammar import JSON_FORMAT
from eyas.sampling.params import SamplingParams
from eyas.tools.spec import ToolRequest
from eyas.tools.syntax import HEAD, CallSyntax

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
LITERALS = ("enum", "const", "default", "examples", "required")  # values, not schemas


def tool_grammar(request: ToolRequest) -> str | None:
    """The Lark grammar of a reply under ``request``; None when the reply is free (tool_choice "none")."""
    tools, syntax = request.callable, request.syntax
    if not tools:
        return None
    lines = ["%llguidance {}"]
    rest = (syntax.opening + HEAD)[len(syntax.trigger):]  # what follows the trigger up to the first name
    if request.choice == "auto" and syntax.trigger_token is None:  # free text ends at the trigger's first match
        lines += [f"start: free | lead {_text(syntax, rest)} calls", "free: TEXT", r"TEXT: /(.|\n)*/",
                  f"lead[lazy]: TEXT {json.dumps(syntax.trigger)}"]
    elif request.choice == "auto":  # free text ends at the special token, and never spells it (the parser's trigger)
        lines += [f"start: free | free {_text(syntax, syntax.opening + HEAD)} calls", "free: TEXT",
                  "ANY: /(?s:.*)/", rf"TEXT: /(.|\n)*/ & ~(ANY {json.dumps(syntax.trigger)} ANY)"]
    else:
        lines += [f"start: {_text(syntax, syntax.opening + HEAD)} calls"]
    more = f" ({_text(syntax, syntax.separator + HEAD)} call)*" if request.parallel else ""
    lines += [f"calls: call{more} {_text(syntax, syntax.closing)}".rstrip(),
              f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        head = json.dumps(f'{tool.name}", {json.dumps(syntax.arguments_key)}: ')
        schema = {**closed(tool.parameters), "x-guidance": JSON_FORMAT}
        lines += [f'call_{i}: {head} args_{i} {_text(syntax, "}" + syntax.suffix)}',
                  f"args_{i}: %json {json.dumps(schema)}"]
    return "\n".join(lines) + "\n"


def _text(syntax: CallSyntax, text: str) -> str:
    """A fixed text in Lark: literals, with llguidance's ``<[id]>`` for each piece the tokenizer holds as one special
    token (``CallSyntax.bind``); nothing for the empty text. Example: ``"[TOOL_CALLS] ["`` with ``[TOOL_CALLS]``
    the special token 5 is ``<[5]> " ["``."""
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p) for p in syntax.pieces(text))


def closed(schema):
    """The schema with ``additionalProperties: false`` on every object that lists ``properties`` and leaves it out.

    A call then holds the keys its tool declares and no invented ones (as OpenAI's strict mode asks);
    what it writes still validates against the schema as given. Example: ``{"properties": {"city": {...}}}``
    becomes ``{"properties": {"city": {...}}, "additionalProperties": false}``.
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in LITERALS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        else:
            out[key] = closed(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def constrain(params: SamplingParams, request: ToolRequest | None) -> SamplingParams:
    """``params`` with the tool grammar as its structured output, and the syntax's special tokens kept in the
    reply's text for the parser (unchanged when no tool may be called)."""
    grammar = tool_grammar(request) if request is not None else None
    if grammar is None:
        return params
    if params.structured_output is not None:
        raise ValueError(f"tools: tool_choice {request.choice!r} constrains the reply, so it cannot also follow a "
                         f"structured output format; drop one of them")
    return dataclasses.replace(params, structured_output={"grammar": grammar},
                               keep_special_token_ids=request.syntax.special_ids)
