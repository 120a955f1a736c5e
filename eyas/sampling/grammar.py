"""Structured output: grammars compiled by llguidance, and one request's position in its grammar.

``SamplingParams.structured_output`` names exactly one kind:

* ``{"json": schema}``: a JSON schema (a dict, or its JSON text);
* ``{"json_object": True}``: any JSON object;
* ``{"regex": pattern}``: the whole output matches the pattern;
* ``{"choice": ["yes", "no"]}``: the output is one of the strings;
* ``{"grammar": text}``: a Lark grammar (llguidance's dialect, rule ``start``), or a GBNF grammar
  (rule ``root``, ``::=``), which is converted to Lark.

JSON is written with the separators ``", "`` and ``": "`` and no other whitespace, as
``json.dumps`` writes it. Free whitespace lets a small model pad forever, and fixed
separators leave more positions where the grammar admits a single token (on the default
model's tokenizer, 57 of the 142 tokens of a nested JSON record), which are free drafts
(``plan_drafts``).

The backend is llguidance: it has no dependencies, one mask takes about 20 us on the default
model's 49k vocabulary, and its masks already keep the tokenizer's canonical splits (after
``{`` with a schema that starts with key ``"name"``, only the token ``{"`` is allowed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from eyas.sampling.grammar_budget import HORIZON, Closer

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_structured_output(spec: object) -> None:
    """The shape of ``SamplingParams.structured_output``; the grammar itself is compiled by the engine."""
    def bad(allowed: str) -> ValueError:
        return ValueError(f"SamplingParams.structured_output={spec!r} is invalid: must be {allowed}")

    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise bad(f"a dict with exactly one of the keys {', '.join(KINDS)}")
    kind, value = next(iter(spec.items()))
    if kind == "json" and not isinstance(value, (dict, str)):
        raise bad('{"json": a JSON schema (a dict or JSON text)}')
    if kind == "json_object" and value is not True:
        raise bad('{"json_object": True}')
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise bad(f'{{"{kind}": a non-empty string}}')
    if kind == "choice" and not (isinstance(value, (list, tuple)) and value
                                 and all(isinstance(c, str) and c for c in value)):
        raise bad('{"choice": a non-empty list of non-empty strings}')


def _grammar_text(kind: str, value) -> str:
    """llguidance's grammar for a checked spec (not yet validated against the tokenizer)."""
    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_FORMAT)
        except ValueError as error:
            raise ValueError(f"structured_output.json: not a JSON object ({error})") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_FORMAT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # Lark string literals are JSON strings
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if "::=" in value:
        try:
            value = gbnf_to_lark(value)
        except Exception as error:  # the converter's own parse errors
            raise ValueError(f"structured_output.grammar: not a valid GBNF grammar ({error})") from None
    return llguidance.LLMatcher.grammar_from_lark(value)


class GrammarCompiler:
    """Compiles specs against one tokenizer; built by the engine, once."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size  # the model's (logits width), >= the tokenizer's
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_json = tokenizer_json  # called once, on the first structured request
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._closer: Closer | None = None  # made with the tokenizer
        self._words: int | None = None  # uint32 words of llguidance's masks (it keeps one past the vocabulary)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first structured request (about 0.2 s for a 49k vocabulary). Until then no copy
        of the tokenizer's JSON is held (about 3 MB for a 49k vocabulary)."""
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
            self._closer = Closer.for_tokenizer(self._tokenizer)
        return self._tokenizer

    def compile(self, spec: dict) -> str:
        """The grammar of a checked spec; ValueError naming the kind and llguidance's message."""
        kind, value = next(iter(spec.items()))
        grammar = _grammar_text(kind, value)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"structured_output.{kind}: {messages[0].strip()}")
        return grammar

    def state(self, grammar: str, max_tokens: int) -> "GrammarState":
        """A request's start in ``grammar``, which must be complete within its ``max_tokens`` output tokens."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()  # compile() validated it
        if self._words is None:
            self._words = len(matcher.compute_bitmask()) // 4
        return GrammarState(matcher, self.vocab_size, frozenset(self.eos_token_ids), max_tokens, self._closer,
                            self._words)


@dataclass
class DraftPlan:
    tokens: list[int]  # the drafts to verify
    forced: list[bool]  # per draft: the grammar admitted this token only
    num_proposed: int  # tokens[:num_proposed] are the proposer's own, the rest are forced tokens it did not draft


UNKNOWN: list[int] = []  # GrammarState._path before it is searched


class GrammarState:
    """One request's position in its grammar: its committed output tokens, consumed, and the tokens its budget
    has left.

    Only the scheduler advances a request's state (``advance``, with each committed token); a request
    whose grammar consumed an end-of-sequence token is finished. The mask filler reads it; drafting
    walks ahead on a ``fork`` (a copy, about 20 us), never on the request's own state. Near the end of the
    budget the allowed tokens are those of the budget-aware close (``eyas.sampling.grammar_budget``).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int],
                 tokens_left: int, closer: Closer, words: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokens_left = tokens_left  # output tokens the request may still emit, this position's included
        self.closer = closer
        self.words = words  # of ``bitmask()``
        self._path: list[int] | None = UNKNOWN  # the close's completion from here (None: none within reach)

    def advance(self, token: int) -> None:
        ok = self.matcher.consume_token(token)
        assert ok, f"token {token} outside the grammar: {self.matcher.get_error()}"
        self.tokens_left -= 1
        self._path = self._path[1:] if self._path and self._path[0] == token else UNKNOWN

    def closing_token(self) -> int | None:
        """The only token the budget-aware close allows here; None while the budget does not bind (far from the end,
        the grammar already complete, or no completion found within reach)."""
        if self.tokens_left > HORIZON or self.matcher.is_accepting():
            return None
        if self._path is UNKNOWN:
            self._path = self.closer.path(self.matcher, min(HORIZON, self.tokens_left))
        if not self._path or len(self._path) + 1 < self.tokens_left:
            return None
        return self._path[0]

    def fork(self, emitted: list[int]) -> "GrammarState | None":
        """A copy advanced over ``emitted`` (this step's tokens, not yet committed); None when they end the
        request (an end-of-sequence token)."""
        if any(t in self.eos_token_ids for t in emitted):
            return None
        copy = GrammarState(self.matcher.deep_copy(), self.vocab_size, self.eos_token_ids, self.tokens_left,
                            self.closer, self.words)
        copy._path = self._path
        for token in emitted:
            copy.advance(token)
        return copy

    def bitmask(self) -> np.ndarray:
        """[words] uint32: bit t % 32 of word t // 32 is set when token t is allowed next."""
        closing = self.closing_token()
        if closing is None:
            return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        return one_token_mask(closing, self.words)

    def only_token(self) -> int | None:
        """The token when the grammar (or the budget-aware close) admits exactly one here, else None.

        A full mask costs about 90 us where text is free (the lazy grammar of tool_choice "auto") and 40 us
        inside JSON on the default model's vocabulary; the forced bytes cost about 3. With a token for every byte
        (byte-level and byte-fallback vocabularies) a single allowed token forces its bytes, so where no byte is
        forced and the grammar is not stopped (when only end-of-sequence is left), more than one token is
        allowed and no mask is needed. (Elsewhere the shortcut can only miss a forced draft, never admit a token
        the grammar forbids: drafts are checked with ``validate_tokens``.)
        """
        closing = self.closing_token()
        if closing is not None:
            return closing
        if not self.matcher.compute_ff_bytes() and not self.matcher.is_stopped():
            return None
        return _single_token(self.bitmask())

    def plan_drafts(self, proposed: list[int], k: int) -> DraftPlan:
        """The drafts to verify from this (forked) position, which it advances over them.

        Walks the proposer's drafts under the grammar: a draft the grammar forbids ends the chain (it
        would cost a row and be rejected); where the grammar admits a single token that token is
        drafted, in place of a proposer's draft that differs (the proposer's later drafts followed
        the wrong token and are dropped); past the proposer's drafts, single-token positions keep
        extending the chain, up to ``k`` drafts in all; nothing follows an end-of-sequence token.

        Example (k = 4): after ``{"age": 3`` the proposer drafts ``[4, }, x]``. ``4`` is allowed
        (one of 12 tokens), ``}`` is allowed, after it only EOS is: ``x`` is replaced by EOS and the
        chain ends there: tokens ``[4, }, EOS]``, forced ``[F, F, T]``, num_proposed 2.
        """
        plan = DraftPlan([], [], 0)
        following = True  # still on the proposer's chain
        while len(plan.tokens) < k:
            only = self.only_token()
            i = len(plan.tokens)
            if following and i < len(proposed):
                token = proposed[i]
                if only is not None and token != only:
                    token, following = only, False
                elif only is None and not (token < self.vocab_size and self.matcher.validate_tokens([token])):
                    break
            elif only is not None:
                token, following = only, False
            else:
                break
            plan.tokens.append(token)
            plan.forced.append(only is not None)
            plan.num_proposed += following
            if token in self.eos_token_ids:
                break
            self.advance(token)
        return plan


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool from an [N, ceil(V / 32)] int32 bitmask (bit t % 32 of word t // 32 = token t)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def one_token_mask(token: int, words: int) -> np.ndarray:
    """[words] uint32 with only ``token``'s bit set."""
    mask = np.zeros(words, dtype=np.uint32)
    mask[token >> 5] = np.uint32(1 << (token & 31))
    return mask


def _single_token(mask: np.ndarray) -> int | None:
    """The token id when the mask allows exactly one token, else None."""
    words = np.flatnonzero(mask)
    if len(words) != 1:
        return None
    word = int(mask[words[0]])
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1
