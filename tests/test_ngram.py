"""The n-gram matcher equals a brute-force search; the proposer drafts exactly from prompt + outputs + emitted."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eyas.spec_decode.config import SpeculativeConfig
from eyas.spec_decode.ngram import NgramProposer, propose_ngram
from eyas.spec_decode.proposer import ProposerInput
from eyas.spec_decode.registry import proposer_class


def brute_force(history: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for it, scan start positions from the most recent earlier one backwards."""
    L = len(history)
    for n in range(max_n, min_n - 1, -1):
        pattern = history[L - n :]
        for start in range(L - n - 1, -1, -1):
            if history[start : start + n] == pattern:
                return history[start + n : start + n + k]
    return []


def ngram(history: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    out = propose_ngram(np.array(history, dtype=np.int64), min_n, max_n, k)
    assert out.dtype == np.int64 and out.ndim == 1 and len(out) <= k
    return out.tolist()


def test_matches_brute_force_on_random_small_alphabets():
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(4000):
        vocab = int(rng.integers(2, 6))
        history = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 5))
        max_n = int(rng.integers(min_n, 7))
        k = int(rng.integers(0, 7))
        expected = brute_force(history, min_n, max_n, k)
        assert ngram(history, min_n, max_n, k) == expected, (history, min_n, max_n, k)
        found += len(expected) > 0
    assert found > 1500  # many cases exercise a real match, not just the empty path


def test_docstring_example_prefers_most_recent_occurrence():
    history = [5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert ngram(history, 1, 3, 2) == [7, 1]
    assert ngram(history, 1, 3, 5) == [7, 1, 2, 3]
    assert ngram([4, 1, 2, 3], 1, 3, 2) == []


@pytest.mark.parametrize(
    "history, min_n, max_n, k, expected",
    [
        ([], 1, 3, 4, []),  # empty history
        ([7], 1, 3, 4, []),  # a single token has nothing earlier
        ([1, 2], 3, 3, 4, []),  # history shorter than n
        ([2, 2], 1, 3, 4, [2]),  # n falls back below the history length
        ([7, 8, 9, 1, 7, 8], 2, 2, 3, [9, 1, 7]),  # match at the very start
        ([1, 2, 3, 4], 1, 3, 4, []),  # nothing repeats
        ([3, 1, 2, 3, 1, 2], 3, 3, 4, [3, 1, 2]),  # match at the start, overlapping the suffix
        ([0, 3, 1, 2, 9, 1, 2], 3, 3, 4, []),  # [9, 1, 2] occurs only as the suffix
        ([0, 3, 1, 2, 9, 1, 2], 2, 3, 4, [9, 1, 2]),  # ... but [1, 2] occurs earlier
        ([1, 2, 1], 1, 2, 5, [2, 1]),  # k longer than the tokens that follow
        ([5, 5, 5, 5], 1, 3, 4, [5]),  # overlapping occurrence: one token follows it
        ([1, 2, 3, 8, 9, 3, 5, 2, 3], 1, 3, 4, [8, 9, 3, 5]),  # longer n beats a more recent shorter match
        ([1, 2, 3, 8, 9, 3, 5, 2, 3], 1, 1, 4, [5, 2, 3]),  # min_n == max_n == 1: most recent [3]
        ([1, 2, 3, 1, 2], 2, 2, 0, []),  # k == 0
    ],
)
def test_edge_cases(history, min_n, max_n, k, expected):
    assert brute_force(history, min_n, max_n, k) == expected  # the reference agrees with the hand answer
    assert ngram(history, min_n, max_n, k) == expected


def _input(token_ids: list[list[int]], emitted: list[list[int]], num_emitted: list[int], k: int) -> ProposerInput:
    R = len(token_ids)
    return ProposerInput(
        request_ids=[str(r) for r in range(R)],
        token_ids=token_ids,
        emitted=torch.tensor(emitted, dtype=torch.int64),
        num_emitted=torch.tensor(num_emitted, dtype=torch.int64),
        num_speculative_tokens=k,
        input_ids=torch.zeros(R, dtype=torch.int64),
        positions=torch.zeros(R, dtype=torch.int64),
        query_start_loc=torch.arange(R + 1, dtype=torch.int64),
        seq_lens=torch.ones(R, dtype=torch.int64),
        sample_rows=list(range(R)),
        hidden_states=None,
        aux_hidden_states=None,
        block_tables=[[[0]] for _ in range(R)],
        next_token_ids=[-1] * R,
        num_drafts=[0] * R,
        expected_drafts=[k] * R,
        seeds=torch.zeros(R, dtype=torch.int64),
        sampling_params=[None] * R,
    )


def test_proposer_drafts_from_history_plus_emitted():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 2})
    proposer = proposer_class("ngram")(spec, SimpleNamespace(device=torch.device("cpu")), None)
    assert isinstance(proposer, NgramProposer) and proposer.method == "ngram"
    inp = _input(
        token_ids=[[1, 2, 3, 4, 1, 2], [9, 8, 7], [1, 2, 3], [4, 4]],
        emitted=[[3, -1, -1, -1], [6, 5, 9, -1], [4, -1, -1, -1], [9, 4, -1, -1]],
        num_emitted=[1, 3, 1, 2],
        k=3,
    )
    out = proposer.propose(inp)
    # row 0: history 1 2 3 4 1 2 3, [2, 3] occurred at 1 -> 4 1 2
    # row 1: history 9 8 7 6 5 9, only [9] repeats -> 8 7 6
    # row 2: history 1 2 3 4 (the -1 padding is not history) -> nothing
    # row 3: history 4 4 9 4, [4] most recently at 1 -> 9 4 (two tokens follow)
    assert out.draft_token_ids.tolist() == [[4, 1, 2], [8, 7, 6], [0, 0, 0], [9, 4, 0]]
    assert out.num_drafts.tolist() == [3, 3, 0, 2]
    assert out.draft_token_ids.dtype == torch.int64 and out.num_drafts.dtype == torch.int64
    assert out.draft_token_ids.device.type == "cpu" and out.draft_probs is None
