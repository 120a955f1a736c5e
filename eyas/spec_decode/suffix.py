"""Suffix decoding (ArcticInference; vLLM's ``method: "suffix"``): model-free drafts from the request's own
text and from every earlier request's output.

Two depth-bounded suffix trees (``eyas.spec_decode.suffix_tree``) answer each step:

* one per request, over its prompt and outputs, appended token by token as they are committed
  (created at the request's first sampling step, dropped when it ends);
* one global tree over the outputs of ended requests (finished or aborted), for the life of the
  engine: at most ``suffix_decoding_max_cached_requests`` outputs, the oldest removed first
  (0 = no global tree).

Each tree offers its best draft for the request's last D = ``suffix_decoding_max_tree_depth``
tokens: the most frequent continuation of a matched suffix of length m, at most
``suffix_decoding_max_spec_factor`` x m tokens (and ``num_speculative_tokens``), cut where its
estimated probability falls below ``suffix_decoding_min_token_prob``. The global draft replaces the
request's own only with a higher score (the sum of its tokens' probabilities). Example: the request's
tree offers [7, 8] with probabilities [1.0, 0.5] (score 1.5) and the global tree [7, 8, 9] with
[1.0, 0.9, 0.9] (score 2.8): [7, 8, 9] is proposed. Drafts carry no probabilities (one-hot, as
n-gram's); their length varies per request and step, and the scheduler's cost model
(``eyas.spec_decode.adaptive``) decides how many are verified. A request the scheduler expects to verify none of
(``ProposerInput.expected_drafts`` 0) still has the step's tokens appended to its tree but gets no tree
walk: at batch 16 the walks cost about 2 ms a step (4% of a forward) on chat prompts whose drafts the cost
model rejects.

``suffix_decoding_cache_file``: the global tree's outputs are read from the file at start when it
exists, and written by ``close`` (``LLM.close``; at interpreter exit otherwise) atomically: into a
temporary file of the same folder, flushed to disk, then renamed over the old one, so a crash at any
moment leaves the old file or the new one, whole.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import weakref
import zipfile
from collections import deque
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from eyas.config import MAX_SPECULATIVE_TOKENS
from eyas.core.step import DoneRequest
from eyas.spec_decode.options import MethodOptions, option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput
from eyas.spec_decode.suffix_tree import Draft, SequenceWriter, SuffixTree, best_draft

logger = logging.getLogger("eyas")

CACHE_FORMAT = "eyas-suffix-cache-1"
_DEPTH, _FACTOR = "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_shape(depth, factor) -> None:
    if not _is_int(depth) or depth < 1:
        raise ValueError(f"speculative_config.{_DEPTH}: {depth!r} must be an int >= 1")
    if not _is_number(factor) or factor < 0:
        raise ValueError(f"speculative_config.{_FACTOR}: {factor!r} must be a number >= 0")


def longest_draft(depth: int, factor: float) -> int:
    """The longest draft the trees can give: a match of m tokens allows floor(m * factor) more, and the tree
    holds depth - m below it (m < depth). Depth 24, factor 1: 12 (m = 12)."""
    return max((min(int(m * factor + 1e-6), depth - m) for m in range(1, depth)), default=0)


class ResponseCache:
    """Outputs of ended requests in one suffix tree; beyond ``max_requests`` the oldest is taken out."""

    def __init__(self, max_depth: int, max_requests: int):
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self.outputs: deque[list[int]] = deque()  # oldest first

    def add(self, tokens: list[int]) -> None:
        self.tree.writer().extend(tokens)
        self.outputs.append(tokens)
        while len(self.outputs) > self.max_requests:
            self.tree.remove(self.outputs.popleft())

    def save(self, path: str, vocab_size: int) -> None:
        save_outputs(path, list(self.outputs), vocab_size)
        logger.info("suffix cache: wrote %d outputs (%d tokens) to %s", len(self.outputs), self.tree.root.count, path)


def save_outputs(path: str, outputs: list[list[int]], vocab_size: int) -> None:
    """Write ``outputs`` atomically: a temporary file in ``path``'s folder, fsync'd, renamed over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    lengths = np.array([len(o) for o in outputs], dtype=np.int64)  # [N]
    tokens = np.fromiter(chain.from_iterable(outputs), dtype=np.int32, count=int(lengths.sum()))  # [sum]
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, format=np.array(CACHE_FORMAT), vocab_size=np.array(vocab_size), lengths=lengths,
                     tokens=tokens)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    folder_fd = os.open(folder, os.O_RDONLY)  # the rename itself reaches the disk
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


def load_outputs(path: str, vocab_size: int) -> list[list[int]]:
    """The outputs saved by ``save_outputs``; ValueError naming the file when it is not such a file or was
    written for another vocabulary."""
    where = f"speculative_config.suffix_decoding_cache_file: '{path}'"
    try:
        with np.load(path) as data:
            fmt, vocab = str(data["format"]), int(data["vocab_size"])
            lengths, tokens = data["lengths"], data["tokens"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{where} is not a suffix cache file ({type(error).__name__}: {error})") from None
    if fmt != CACHE_FORMAT:
        raise ValueError(f"{where} has format {fmt!r}, expected {CACHE_FORMAT!r}")
    if vocab != vocab_size:
        raise ValueError(f"{where} was written for a vocabulary of {vocab} tokens, this model has {vocab_size}; "
                         f"use another file for this model")
    if lengths.ndim != 1 or (lengths < 0).any() or lengths.sum() != len(tokens) or \
            (len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size)):
        raise ValueError(f"{where} is damaged (lengths do not add up or token ids fall outside the vocabulary)")
    return [chunk.tolist() for chunk in np.split(tokens, np.cumsum(lengths)[:-1])] if len(lengths) else []


@dataclass(frozen=True)
class SuffixOptions(MethodOptions):
    """vLLM's names and defaults."""

    suffix_decoding_max_tree_depth: int = option(24, "suffix: depth of the suffix trees, match plus draft (default 24)",
                                                 flag="--suffix-max-tree-depth", parse=int)
    suffix_decoding_max_cached_requests: int = option(
        10000, "suffix: outputs kept in the global tree, the oldest evicted first (default 10000; 0 = none)",
        flag="--suffix-max-cached-requests", parse=int)
    suffix_decoding_max_spec_factor: float = option(
        1.0, "suffix: draft at most this many tokens per matched token (default 1.0)", flag="--suffix-max-spec-factor",
        parse=float)
    suffix_decoding_min_token_prob: float = option(
        0.1, "suffix: stop a draft where its estimated probability falls below this (default 0.1)",
        flag="--suffix-min-token-prob", parse=float)
    suffix_decoding_cache_file: str | None = option(
        None, "suffix: load the global tree from FILE at start (if it exists), save it there at exit",
        flag="--suffix-cache", parse=str)

    def validate(self) -> None:
        _check_shape(self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_spec_factor)
        cached, prob = self.suffix_decoding_max_cached_requests, self.suffix_decoding_min_token_prob
        if not _is_int(cached) or cached < 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_cached_requests: {cached!r} must be an int "
                             f">= 0 (0 = no global tree)")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob: {prob!r} must be a number in [0, 1]")
        path = self.suffix_decoding_cache_file
        if path is None:
            return
        where = f"speculative_config.suffix_decoding_cache_file: {path!r}"
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"{where} must be a file path")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{where}: its folder {folder} does not exist")
        if os.path.isdir(path):
            raise ValueError(f"{where} is a folder; give a file path")
        if cached == 0:
            raise ValueError(f"{where} needs the global tree, which suffix_decoding_max_cached_requests=0 turns off")

    def longest_draft(self) -> int:
        """The longest draft these options allow, as a k (12 for the defaults)."""
        return min(max(1, longest_draft(self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_spec_factor)),
                   MAX_SPECULATIVE_TOKENS)


class SuffixProposer(Proposer):
    """Per-request suffix trees plus the global tree of earlier outputs; drafts from whichever scores higher."""

    method = "suffix"
    Options = SuffixOptions

    @classmethod
    def default_num_speculative_tokens(cls, config: dict) -> int:
        """vLLM defaults k to the tree depth, a bound drafts never reach: eyas takes the longest draft the
        depth and factor allow (12 for the defaults), since k also sizes every request's lookahead slots."""
        depth, factor = config.get(_DEPTH, 24), config.get(_FACTOR, 1.0)
        _check_shape(depth, factor)
        return SuffixOptions(suffix_decoding_max_tree_depth=depth, suffix_decoding_max_spec_factor=factor).longest_draft()

    def __init__(self, spec_config, engine_config, target):
        options = spec_config.options
        self.k = spec_config.num_speculative_tokens
        self.depth = options.suffix_decoding_max_tree_depth
        self.factor = options.suffix_decoding_max_spec_factor
        self.min_prob = options.suffix_decoding_min_token_prob
        self.device = engine_config.device
        self.requests: dict[str, SequenceWriter] = {}  # request id -> its own tree, holding prompt + outputs
        max_cached = options.suffix_decoding_max_cached_requests
        self.cache = ResponseCache(self.depth, max_cached) if max_cached > 0 else None
        self._save = None
        path = options.suffix_decoding_cache_file
        if path is not None:
            path, vocab_size = os.fspath(path), engine_config.model.vocab_size
            if os.path.exists(path):
                for output in load_outputs(path, vocab_size):
                    self.cache.add(output)
                logger.info("suffix cache: loaded %d outputs (%d tokens, %d tree nodes) from %s",
                            len(self.cache.outputs), self.cache.tree.root.count, self.cache.tree.num_nodes, path)
            self._save = weakref.finalize(self, self.cache.save, path, vocab_size)  # runs once: close() or exit

    def propose(self, inp: ProposerInput) -> ProposerOutput:
        return self.propose_scored(inp)[0]

    def propose_scored(self, inp: ProposerInput) -> tuple[ProposerOutput, list[float]]:
        """``propose``, and each row's draft score [R] (the sum of its tokens' estimated probabilities; 0: no
        draft), which ``eyas.spec_decode.suffix_hybrid`` weighs against a model drafter."""
        R, k = len(inp.request_ids), self.k
        scores = [0.0] * R
        emitted = inp.emitted.tolist()  # [R][k'+1]
        num_emitted = inp.num_emitted.tolist()  # [R]
        drafts = np.zeros((R, k), dtype=np.int64)  # [R, k], padded with 0
        num_drafts = np.zeros(R, dtype=np.int64)  # [R]
        for r, request_id in enumerate(inp.request_ids):
            if not inp.sampling_params[r].speculate:  # opted out: no tree, no drafts
                continue
            writer = self.requests.get(request_id)
            if writer is None:
                writer = self.requests[request_id] = SuffixTree(self.depth).writer()
            history = inp.token_ids[r]
            assert len(writer.tokens) <= len(history), "a live request's committed tokens only grow"
            writer.extend(history[len(writer.tokens):])  # the prompt at first, then nothing: emitted came last step
            writer.extend(emitted[r][:num_emitted[r]])
            if inp.expected_drafts[r] == 0:  # the scheduler will verify none: the tokens are in, skip the walks
                continue
            draft = self._draft(writer)
            if draft is not None:
                drafts[r, :len(draft.tokens)] = draft.tokens
                num_drafts[r] = len(draft.tokens)
                scores[r] = draft.score
        return ProposerOutput(
            draft_token_ids=torch.from_numpy(drafts).to(self.device),
            num_drafts=torch.from_numpy(num_drafts).to(self.device),
            draft_probs=None,
        ), scores

    def _draft(self, writer: SequenceWriter) -> Draft | None:
        own = best_draft(writer.matches(), self.depth, self.k, self.factor, self.min_prob)
        if self.cache is None:
            return own
        context = writer.tokens[-self.depth:]
        other = best_draft(self.cache.tree.matches(context), self.depth, self.k, self.factor, self.min_prob,
                           beat=own.score if own is not None else 0.0)
        return other if other is not None else own

    def request_done(self, done: DoneRequest) -> None:
        self.requests.pop(done.request_id, None)
        if self.cache is not None and len(done.token_ids) > done.num_prompt_tokens:
            self.cache.add(done.token_ids[done.num_prompt_tokens:])

    def close(self) -> None:
        if self._save is not None:
            self._save()
