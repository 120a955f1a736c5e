"""Tool calls read back out of generated text, whole or while it streams.

The grammar (``eyas.tools.grammar``) writes every call as ``<tool_call>\\n{"name": N, "arguments": A}\\n
</tool_call>`` with fixed separators, so the arguments are the exact text between the head and the
tail: nothing is re-serialised, and a stream's argument pieces join into the same string the whole
reply holds. Text before the first ``<tool_call>`` is the reply's content.

Example: ``'Let me check.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>'``
parses to content ``"Let me check."`` and one call ``get_weather`` with arguments ``'{"city": "Paris"}'``.
While streaming (``final=False``) the same text cut after ``{"city": "Pa`` gives the call's name and
arguments ``'{"city": "Pa'`` so far, less the tail's length held back (it may be the tail forming);
content holds back a suffix that could be the start of ``<tool_call>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TRIGGER = "<tool_call>"
CLOSE = "</tool_call>"
HEAD = re.compile(r'\n\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
TAIL = "}\n" + CLOSE


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object's JSON text (complete calls parse; a streaming one may be partial)
    complete: bool = True


@dataclass
class ParsedReply:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def parse_reply(text: str, final: bool = True) -> ParsedReply:
    """``final``: the reply is whole; a last call cut short (by max_tokens) is left out, and when the first
    call does not parse the whole text is content."""
    content, *segments = text.split(TRIGGER)
    if not final and not segments:
        return ParsedReply(content[:len(content) - _partial_trigger(content)])
    calls = []
    for i, segment in enumerate(segments):
        call = _call(segment, last=i == len(segments) - 1, final=final)
        if call is None:
            return ParsedReply(text) if final and not calls else ParsedReply(content, calls)
        calls.append(call)
    return ParsedReply(content, calls)


def _call(segment: str, last: bool, final: bool) -> ToolCall | None:
    head = HEAD.match(segment)
    if head is None:
        return None  # not a call (whole), or its head still forming (streaming)
    name = json.loads(f'"{head.group(1)}"')
    end = segment.find(TAIL, head.end())
    if end >= 0:
        arguments = segment[head.end():end]
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(name, arguments)
    if final or not last:
        return None
    return ToolCall(name, segment[head.end():max(head.end(), len(segment) - len(TAIL))], complete=False)


def _partial_trigger(text: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``<tool_call>`` (held back while streaming)."""
    for n in range(min(len(TRIGGER) - 1, len(text)), 0, -1):
        if TRIGGER.startswith(text[-n:]):
            return n
    return 0
