"""The budget-aware close: a reply under a grammar ends complete within its ``max_tokens``.

Without it a grammar keeps every reply *valid so far*, but a model that loops inside a string (a 135M model
repeating an email body) runs into ``max_tokens`` with the object still open, and the cut-off reply is
invalid. The rule: at every position, while the grammar is not complete, take the shortest completion
``path`` the grammar allows from there. Once the tokens left in the request's budget fall to
``len(path) + 1`` (the path, then the end-of-sequence token), the path's next token is the only one
allowed. From then on every position is forced, so the closing tokens are forced drafts for every drafter.

Why this rule:

* **It only changes replies that would not have finished.** A reply that completes within its budget
  never has fewer tokens left than its own completion needs, so the rule binds only where the reply's
  own completion is itself a shortest one (and then it may pick a different shortest one).
* **It is lossless under speculation.** The allowed set at a position depends only on the grammar
  position and the tokens left there (``GrammarState``), which are the same whether the token comes
  from a draft row or a plain decode, so greedy output is token-identical with and without drafts.
* **It costs nothing far from the end.** The path is searched only within ``HORIZON`` tokens of the
  budget, and it is kept while the reply follows it.

The path is found by a greedy walk (llguidance gives no shortest completion): forced tokens as the
grammar forces them (``compute_ff_tokens``); where the grammar allows several, the first allowed of the
tokenizer's *closers*: an empty string ``""``, ``"`` then ``}`` and ``]`` (longest first, so ``"}}`` beats
``"``), then ``}`` and ``]`` alone, then the shortest values (``0``, ``[]``, ``{}``, ``true``, ``false``,
``null``, an opening ``"``); else the lowest allowed token id. The walk is not a proof of the shortest completion: a grammar whose
completion it does not find within ``HORIZON`` tokens (a ``minLength`` string, a ``pattern``) gets no
close and may still be cut. A token that lengthens the completion (opening an optional array item) with
fewer tokens left than the longer completion needs can also still be cut: the rule steers, it does not
look ahead of the model's own choice. And at the first key of an object whose keys are all optional the
walk opens a key where ``}`` would close it: the close may start earlier there than it needs to.

Example (a byte-level tokenizer, grammar ``{"body": <string>}``, max_tokens 12): after the 9 tokens
``{"body": "`` and ``hi hi`` cut to ``{"body": "hi`` with 3 tokens left, the path is ``"`` ``}``
(2 tokens, complete after it): 3 <= 2 + 1, so only ``"`` is allowed, then only ``}``, then the
end-of-sequence token: ``{"body": "hi"}``, finished by the grammar inside the budget.
"""

from __future__ import annotations

import itertools

import llguidance
import numpy as np

HORIZON = 48  # tokens before the end of the budget where the close is searched
CLOSING_CHARS = ("}", "]")
SHORT_VALUES = ("0", "[]", "{}", "true", "false", "null", '"')


class Closer:
    """A tokenizer's preferred closing tokens, and the walk that finds a completion with them."""

    def __init__(self, preferred: list[int]):
        self.preferred = np.asarray(preferred, dtype=np.int64)  # [P] token ids, the first allowed wins

    @classmethod
    def for_tokenizer(cls, tokenizer: llguidance.LLTokenizer) -> Closer:
        """The single tokens among ``""``, the closing strings and the short values, in that order. Closing strings:
        ``"`` then any mix of ``}]`` (up to 4 characters, longest first), then the mixes of ``}]`` alone. Where a
        value starts, ``"]]`` would open a string and write ``]]`` into it, so the empty string comes first; inside
        a string a plain ``]]`` is text, so the strings that close it come before those."""
        mixes = [["".join(p) for p in itertools.product(CLOSING_CHARS, repeat=n)] for n in (4, 3, 2, 1, 0)]
        closers = ['"' + m for group in mixes[1:] for m in group] + [m for group in mixes[:-1] for m in group]
        preferred: list[int] = []
        for text in ['""', *closers, *SHORT_VALUES]:
            tokens = tokenizer.tokenize_str(text)
            if len(tokens) == 1 and tokens[0] not in preferred:
                preferred.append(tokens[0])
        return cls(preferred)

    def path(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """The tokens of a short completion from ``matcher``'s position (left unchanged), up to the first position
        where the grammar is complete; None when the walk needs more than ``limit`` tokens."""
        walk, path = matcher.deep_copy(), []
        while not walk.is_accepting():
            step = walk.compute_ff_tokens() or [self._choose(walk)]
            path += step
            if len(path) > limit or not walk.consume_tokens(step):
                return None
        return path

    def _choose(self, walk: llguidance.LLMatcher) -> int:
        mask = np.frombuffer(walk.compute_bitmask(), dtype=np.uint32)  # [ceil(V / 32)]
        ok = self.preferred[(mask[self.preferred >> 5] >> (self.preferred & 31)) & 1 == 1]
        if len(ok):
            return int(ok[0])
        word = int(np.flatnonzero(mask)[0])
        return word * 32 + (int(mask[word]) & -int(mask[word])).bit_length() - 1
