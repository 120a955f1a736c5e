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

A tokenizer may hold a piece of these texts as one *special* token: Mistral's v3 tokenizers hold ``[TOOL_CALLS]``
as a control token, which the model emits as that one token and never spells in plain pieces. ``bind`` finds
such pieces (``special``): the grammar names their tokens, and the reply's text keeps them for the parser
(special tokens are otherwise dropped from the text). A trigger is plain text or one special token.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from eyas.model.tokenizer import Tokenizer

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
    special: tuple[tuple[str, int], ...] = ()  # (text, token id): the pieces a tokenizer holds as a special token

    def bind(self, tokenizer: Tokenizer) -> CallSyntax:
        """This syntax as ``tokenizer`` writes it: ``special`` lists the pieces of its fixed texts that the tokenizer
        encodes as one special token. Example: Mistral's syntax on a v3 tokenizer, where ``[TOOL_CALLS]`` is the
        special token 5, gets ``special=(("[TOOL_CALLS]", 5),)``; where the tokenizer has no such token (or holds the
        text as an ordinary added token, as Qwen's does ``<tool_call>``) the syntax comes back as it is."""
        found = {}
        for text in (self.opening, self.suffix, self.separator, self.closing):
            for token in tokenizer.encode(text, add_special_tokens=False):
                if token in tokenizer.special_ids:
                    found[tokenizer.decode([token], skip_special_tokens=False)] = token
        return dataclasses.replace(self, special=tuple(found.items())) if found else self

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The special tokens whose text the reply keeps, so that the parser reads them."""
        return tuple(token for _, token in self.special)

    @property
    def trigger_token(self) -> int | None:
        """The special token that is the trigger (``bind``); None when the trigger is text."""
        return dict(self.special).get(self.trigger)

    def pieces(self, text: str) -> list[str | int]:
        """``text`` as plain pieces and the ids of the special tokens in it (``special``), in order. Example: with
        ``special=(("[TOOL_CALLS]", 5),)``, ``"[TOOL_CALLS] ["`` is ``[5, " ["]``."""
        if not self.special:
            return [text] if text else []
        ids = dict(self.special)
        return [ids.get(part, part) for part in re.split(f"({'|'.join(map(re.escape, ids))})", text) if part]

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
