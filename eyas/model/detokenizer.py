"""Streaming detokenization: text deltas from token ids arriving a few at a time."""

from __future__ import annotations

from collections.abc import Iterable

from eyas.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each step decodes only a short window: the ids since ``prefix`` (already-emitted tokens kept
    as context, so decoders that strip a leading space or merge bytes see their neighbours) and
    compares it with the decoding of ``ids[prefix:read]``. The surplus is the delta, unless it
    ends in U+FFFD, which means a UTF-8 character is split across tokens: then nothing is
    emitted until a later token completes it.

    Example with byte-level BPE, where "é" (C3 A9) is split over two tokens:
        add([t_a])   -> "a"
        add([t_C3])  -> ""      # decodes to "a\\ufffd": held back
        add([t_A9])  -> "é"
        flush()      -> ""
    so "".join(deltas) + flush() == tokenizer.decode(all_ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = keep  # special tokens whose text stays (``Tokenizer.decode``)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded in the previous emitting step
        self.read = 0  # ids[:read] are fully emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.keep)

    def add(self, new_ids: int | Iterable[int]) -> str:
        """Append ``new_ids``; return the text they complete (possibly "")."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back rest (with U+FFFD for an incomplete final character), at end of stream."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text) :]
