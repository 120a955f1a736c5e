"""The tokenizer of a Hugging Face model folder: ``tokenizers`` for text <-> ids, plus the
special-token ids and the jinja2 chat template from the folder's JSON files."""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken dict {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _as_ids(value) -> list[int]:
    """An ``eos_token_id`` entry: absent, one id, or a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """A chat template compiled the way transformers does (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68
    take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        source: str = "<memory>",
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        if self.eos_token_id is None and extra_eos_token_ids:
            self.eos_token_id = extra_eos_token_ids[0]
        eos = {self.eos_token_id, *extra_eos_token_ids} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        self.source = source
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)  # special and added tokens: text as is
        self.special_ids = frozenset(i for i, token in added.items() if token.special)  # skip_special_tokens drops

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> Tokenizer:
        """Load ``tokenizer.json`` plus special tokens from ``tokenizer_config.json``,
        ``generation_config.json`` and ``config.json`` (eos ids from all three)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {path / 'tokenizer.json'} does not exist; eyas needs a fast-tokenizer file")
        tok_config = _read_json(path / "tokenizer_config.json")
        eos_ids = _as_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        eos_ids += _as_ids(_read_json(path / "config.json").get("eos_token_id"))
        chat_template = tok_config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        if chat_template is None and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            HFTokenizer.from_file(str(path / "tokenizer.json")),
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            extra_eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            chat_template=chat_template,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens``, the tokenizer.json post-processor
        runs, and bos is prepended if tokenizer_config asks for it and it is not there yet."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, exact even when it holds part of a UTF-8 character (``decode`` of
        such a token alone gives U+FFFD). Byte-level BPE maps each byte to one printable character (GPT-2's
        table, ``_byte_level_table``); SentencePiece-style vocabularies write bytes as ``<0xE2>`` and spaces
        as ``\u2581``. Example (SmolLM2): token 40303 is ``\u0120\u00f0\u0141\u013a``: bytes ``20 f0 9f 98``, a
        space and the first three bytes of an emoji."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if type(self.backend.decoder).__name__ == "ByteLevel":
            table = _byte_level_table()
            return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: tuple[int, ...] = ()) -> str:
        """``keep``: special tokens whose text stays where ``skip_special_tokens`` drops the others (a tool-call
        syntax's markers, such as Mistral's ``[TOOL_CALLS]``, which the call parser reads)."""
        if skip_special_tokens and keep:  # the backend drops special tokens by the same test
            ids, skip_special_tokens = [t for t in ids if t in keep or t not in self.special_ids], False
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the conversation as a prompt string (like HF's ``tokenize=False``); extra
        keyword arguments (``tools``, ``enable_thinking``...) are passed to the template."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer: no chat_template in {self.source}/tokenizer_config.json")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
