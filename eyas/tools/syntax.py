"""A model family's tool-call syntax: the text around its calls, and which chat templates write it.

Every syntax eyas knows writes a call as the JSON object ``{"name": "<tool>", "<arguments key>": <arguments>}``
with JSON's fixed separators; what differs is the text around the calls. A reply's calls read
``opening + call + suffix + (separator + call + suffix)* + closing``. Example, Hermes's syntax with two calls::

    <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>\\n<tool_call>\\n{"name": "g", ...}\\n</tool_call>

``opening`` = ``<tool_call>\\n``, ``suffix`` = ``\\n</tool_call>``, ``separator`` = ``\\n<tool_call>\\n``,
``closing`` = ``""``. ``trigger`` is the start of ``opening + '{"name": '`` that tells a call from text
(``tool_choice`` "auto" is free text until it appears). One file per syntax (``hermes``, ``llama3_json``,
``mistral``); ``eyas.tools.syntaxes`` picks one by the chat template. The grammar (``eyas.tools.grammar``)
and the parser (``eyas.tools.parse``) are written once, over these fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

HEAD = '{"name": "'  # every call object starts so


@dataclass(frozen=True)
class CallSyntax:
    name: str
    opening: str  # before the first call
    arguments_key: str  # "arguments" or "parameters"
    suffix: str  # after each call object
    separator: str  # between two calls (before the next call's object)
    closing: str  # after the last call
    trigger: str  # a prefix of opening + HEAD: where a call starts in free text
    markers: tuple[str, ...]  # a chat template that holds all of these writes this syntax itself

    def knows(self, template: str) -> bool:
        """The template renders tools and tool calls in this syntax itself."""
        return all(marker in template for marker in self.markers)

    def native_id(self, call_id: str) -> str:
        """A call id as this family's templates accept it (the same id for the call and its result)."""
        return call_id

    def call_text(self, name: str, arguments: dict) -> str:
        """One call object, as the grammar writes it."""
        key = json.dumps(self.arguments_key)
        return f"{HEAD}{name}\", {key}: {json.dumps(arguments, ensure_ascii=False)}}}"

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        """A reply's calls, as the grammar writes them."""
        return self.opening + self.separator.join(self.call_text(n, a) + self.suffix for n, a in calls) + self.closing
