"""Deterministic benchmark prompt sets built from real ShareGPT conversations.

Each set is the first ``n`` qualifying items in file order, so the same ``n`` always gives the
same prompts and a larger ``n`` extends a smaller one. A prompt is a single-turn conversation
``[{"role": "user", "content": ...}]`` ready for a chat template.

- :func:`chat_prompts`: opening user requests of moderate length (ordinary chat traffic).
- :func:`copy_prompts`: edit-style requests that quote a real assistant answer and ask for it
  back nearly verbatim; the answer is mostly a copy of the prompt, which is what n-gram
  (prompt-lookup) speculative decoding exploits.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

from eyas.data.sharegpt import iter_sharegpt

COPY_INSTRUCTIONS = (
    "Rewrite the following passage, fixing any typos but otherwise keeping it word for word:",
    "Proofread the following text and return the corrected version in full, changing as little "
    "as possible:",
    "Repeat the following passage exactly, only replacing British spellings with American ones:",
    "Reformat the following text as Markdown, keeping every sentence word for word:",
)

# English function words; a prose text has 20-50% of its words in this set. Words shared with
# common Romance-language function words ("a", "me", "de") are left out.
_ENGLISH_WORDS = frozenset(
    "the to and of is in you for it how what that this with on are my your be can i an please "
    "write do as if from not or have will which would should".split()
)
_WORD = re.compile(r"\b[a-z']+\b")
# ShareGPT "split" ids: "QWJhYvA_0" opens a chat, "QWJhYvA_1", ... continue it mid-dialogue.
_CONTINUATION_ID = re.compile(r"_[1-9][0-9]*$")


# conversations [0, HELD_OUT_START) of the shipped file are drafter training data; the rest is held out
HELD_OUT_START = 13_000


def _openings(path: str | Path | None, start: int = 0) -> Iterator[list[dict[str, str]]]:
    """Messages of the conversations (from index ``start`` on) that are not continuation parts of a split chat."""
    for conversation in itertools.islice(iter_sharegpt(path), start, None):
        if not _CONTINUATION_ID.search(conversation.id):
            yield conversation.messages


def chat_prompts(
    n: int, max_chars: int = 1500, min_chars: int = 32, path: str | Path | None = None, start: int = 0
) -> list[list[dict[str, str]]]:
    """The first ``n`` distinct opening user turns with ``min_chars <= len <= max_chars``.

    Only chat openings count (not the ``_1``, ``_2``, ... continuation parts of split ShareGPT
    chats) that start with a user turn after optional system turns; the text must be mostly
    English (:func:`is_mostly_english`), and ``max_chars`` keeps out giant pastes of code or
    documents. Raises ``ValueError`` when fewer than ``n`` qualify (about 7k do by default).
    ``start``: skip the first conversations of the file (``HELD_OUT_START``: only held-out ones,
    never seen by a drafter trained on the first 13,000).
    """
    _check_counts(n, min_chars, max_chars)

    def candidates() -> Iterator[str]:
        for messages in _openings(path, start):
            first = next((m for m in messages if m["role"] != "system"), None)
            if first is not None and first["role"] == "user":
                yield first["content"].strip()

    texts = _first_distinct(candidates(), n, min_chars, max_chars, min_english=0.08)
    return [[{"role": "user", "content": text}] for text in texts]


def copy_prompts(
    n: int, min_chars: int = 400, max_chars: int = 1200, path: str | Path | None = None
) -> list[list[dict[str, str]]]:
    """``n`` copy-heavy requests: ``COPY_INSTRUCTIONS[i % 4]`` + a real assistant passage.

    The passage of prompt ``i`` is the first assistant answer of a chat opening (see
    :func:`chat_prompts`) whose length is within ``[min_chars, max_chars]`` and that reads as
    English prose (at least 15% English function words); one passage per conversation, distinct
    passages only, about 4.7k by default. Example::

        Rewrite the following passage, fixing any typos but otherwise keeping it word for word:

        Here are the main ideas of Jeff Walker's Product Launch Formula that ...
    """
    _check_counts(n, min_chars, max_chars)

    def candidates() -> Iterator[str]:
        for messages in _openings(path):
            for message in messages:
                text = message["content"].strip()
                if message["role"] == "assistant" and min_chars <= len(text) <= max_chars:
                    yield text
                    break

    passages = _first_distinct(candidates(), n, min_chars, max_chars, min_english=0.15)
    return [
        [{"role": "user", "content": f"{COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]}\n\n{p}"}]
        for i, p in enumerate(passages)
    ]


def is_mostly_english(text: str, min_english: float) -> bool:
    """True when >= 95% of the letters are ASCII and, for texts of 8+ words, at least a
    ``min_english`` fraction of the words are English function words.

    Curly quotes, dashes and emoji are not letters, so they do not count against a text;
    Chinese or Korean text fails the first test, Spanish or pure code the second.
    """
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.95 * len(letters):
        return False
    words = _WORD.findall(text.lower())
    if len(words) < 8:
        return True
    return sum(w in _ENGLISH_WORDS for w in words) >= min_english * len(words)


def _first_distinct(
    texts: Iterator[str], n: int, min_chars: int, max_chars: int, min_english: float
) -> list[str]:
    chosen: list[str] = []
    seen: set[str] = set()
    if n == 0:
        return chosen
    for text in texts:
        if min_chars <= len(text) <= max_chars and text not in seen:
            if is_mostly_english(text, min_english):
                chosen.append(text)
                seen.add(text)
                if len(chosen) == n:
                    return chosen
    raise ValueError(
        f"only {len(chosen)} ShareGPT texts qualify (n={n}, min_chars={min_chars}, "
        f"max_chars={max_chars}); lower n or widen the length range"
    )


def _check_counts(n: int, min_chars: int, max_chars: int) -> None:
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    if not 0 <= min_chars <= max_chars:
        raise ValueError(
            f"min_chars={min_chars}, max_chars={max_chars}: need 0 <= min_chars <= max_chars"
        )
