"""Tool calls read back out of generated text, whole or while it streams, in the request's call syntax.

The grammar (``eyas.tools.grammar``) writes every call as ``{"name": N, "<key>": A}`` with fixed separators,
between the syntax's fixed texts (``eyas.tools.syntax``), so the arguments are the exact text of the JSON
value after the key: nothing is re-serialised, and a stream's argument pieces join into the same string the
whole reply holds. Text before the syntax's trigger is the reply's content. A trigger the tokenizer holds as one
special token (Mistral v3's ``[TOOL_CALLS]``) is in the text: the reply is decoded with the syntax's special tokens
kept (``eyas.tools.grammar.constrain``).

Example (Hermes): ``'Let me check.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n
</tool_call>'`` parses to content ``"Let me check."`` and one call ``get_weather`` with arguments
``'{"city": "Paris"}'``. While streaming (``final=False``) the same text cut after ``{"city": "Pa`` gives the
call's name and arguments ``'{"city": "Pa'`` so far (an arguments object not yet closed is all arguments);
content holds back a suffix that could be the start of the trigger.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from eyas.tools.syntax import HEAD, CallSyntax

NAME = re.compile(r'((?:[^"\\]|\\.)*)", "(\w+)": ')
DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object's JSON text (complete calls parse; a streaming one may be partial)
    complete: bool = True


@dataclass
class ParsedReply:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def parse_reply(text: str, syntax: CallSyntax, final: bool = True) -> ParsedReply:
    """``final``: the reply is whole; a last call cut short (by max_tokens) is left out, and when the first
    call does not parse the whole text is content (less the syntax's special tokens, which the text keeps only for
    this parser: ``CallSyntax.bind``)."""
    start = text.find(syntax.trigger)
    if start < 0:
        return ParsedReply(text if final else text[:len(text) - _partial(text, syntax.trigger)])
    content, calls, at, lead = text[:start], [], start, syntax.opening + HEAD
    while text.startswith(lead, at):
        call, at = _call(text, at + len(lead), syntax, final)
        if call is None:
            break
        calls.append(call)
        if not call.complete:
            break
        lead = syntax.separator + HEAD
    if final and not calls:
        return ParsedReply("".join(p for p in syntax.pieces(text) if isinstance(p, str)))
    return ParsedReply(content, calls)


def _call(text: str, at: int, syntax: CallSyntax, final: bool) -> tuple[ToolCall | None, int]:
    """The call whose name starts at ``at``, and where the text after it starts; None when there is none
    (cut short when ``final``; its name still forming while streaming)."""
    head = NAME.match(text, at)
    if head is None or head.group(2) != syntax.arguments_key:
        return None, at
    name, begin = json.loads(f'"{head.group(1)}"'), head.end()
    try:
        arguments, end = DECODER.raw_decode(text, begin)
    except ValueError:  # not closed yet: everything after the key is arguments so far
        return (None if final else ToolCall(name, text[begin:], complete=False)), len(text)
    if not isinstance(arguments, dict):
        return None, at
    tail = "}" + syntax.suffix
    if text.startswith(tail, end):
        return ToolCall(name, text[begin:end]), end + len(tail)
    if final or not tail.startswith(text[end:end + len(tail)]):
        return None, at
    return ToolCall(name, text[begin:end], complete=False), len(text)


def _partial(text: str, trigger: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``trigger`` (held back while streaming)."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0
