"""Suffix decoding: options, drafts from the request's own tree and from the global tree of earlier outputs,
eviction, the engine telling the proposer when requests end, and the cache file (round trip, kill -9)."""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import host_input, run_counting_preemptions

from eyas import LLM, SamplingParams
from eyas.core.step import DoneRequest
from eyas.spec_decode.config import SpeculativeConfig
from eyas.spec_decode.suffix import SuffixProposer, load_outputs, longest_draft, save_outputs
from eyas.spec_decode.suffix_tree import SuffixTree

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SUFFIX = {"method": "suffix", "verification": "shared_noise"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("suffix") / "target", "llama", num_hidden_layers=4))


def _prompts(n: int, seed: int, length: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _accepted(outs) -> int:
    return sum(o.spec_metrics["num_accepted"] for o in outs)


# -- options ---------------------------------------------------------------------------------------------
def test_defaults_follow_vllm_and_k_is_the_longest_possible_draft():
    config = SpeculativeConfig.from_dict({"method": "suffix"})
    options = config.options
    assert (options.suffix_decoding_max_tree_depth, options.suffix_decoding_max_cached_requests,
            options.suffix_decoding_max_spec_factor, options.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert config.num_speculative_tokens == 12  # match 12 + draft 12 = depth 24
    assert longest_draft(24, 1.0) == 12 and longest_draft(10, 2.0) == 6 and longest_draft(1, 1.0) == 0
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8}).num_speculative_tokens == 4
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_spec_factor": 4.0}).num_speculative_tokens == 16
    assert SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3}).num_speculative_tokens == 3


BAD_OPTIONS = [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth: 0 must be an int >= 1"),
    ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth: 2.5 must be an int"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests: -1 must be an int >= 0"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor: -0.5 must be a number >= 0"),
    ({"suffix_decoding_max_spec_factor": float("nan")}, "suffix_decoding_max_spec_factor: nan"),
    ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob: 1.5 must be a number in \[0, 1\]"),
    ({"suffix_decoding_min_token_prob": "high"}, "suffix_decoding_min_token_prob: 'high'"),
    ({"suffix_decoding_cache_file": "/no/such/folder/cache.npz"}, "its folder /no/such/folder does not exist"),
    ({"suffix_decoding_cache_file": "CACHE", "suffix_decoding_max_cached_requests": 0}, "needs the global tree"),
    ({"suffix_decoding_cache_file": "TMP"}, "is a folder; give a file path"),
    ({"num_speculative_tokens": 17}, r"num_speculative_tokens: 17 must be an int in \[1, 16\]"),
]


def test_bad_options_are_clear_errors_and_the_engine_keeps_serving(target, tmp_path):
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=SUFFIX)
    prompts = _prompts(2, seed=1)
    before = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    for options, message in BAD_OPTIONS:
        named = {"CACHE": str(tmp_path / "cache.npz"), "TMP": str(tmp_path)}
        options = {k: named.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
        with pytest.raises(ValueError, match=message):
            LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config={**SUFFIX, **options})
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before


def test_suffix_options_belong_to_suffix_only():
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob: not used by method 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.5})


# -- the proposer on hand-made inputs ---------------------------------------------------------------------------
def _proposer(**options) -> SuffixProposer:
    config = SpeculativeConfig.from_dict({"method": "suffix", **options})
    return SuffixProposer(config, SimpleNamespace(device=torch.device("cpu"), model=SimpleNamespace(vocab_size=320)),
                          None)


def _step(proposer, rows: dict[str, tuple[list[int], list[int]]], speculate=True,
          expected: int | None = None) -> dict[str, list[int]]:
    """One propose call: request id -> (committed tokens, tokens emitted this step); returns the drafts.
    ``expected``: the drafts the scheduler expects to verify per row (default k)."""
    ids = list(rows)
    out = proposer.propose(host_input(rows, proposer.k, expected, SamplingParams(speculate=speculate)))
    counts = out.num_drafts.tolist()
    return {i: out.draft_token_ids[r, :counts[r]].tolist() for r, i in enumerate(ids)}


def test_drafts_come_from_the_request_itself_then_from_earlier_outputs():
    proposer = _proposer()
    text = [10, 11, 12, 13, 14, 15, 16, 17]
    # the request's own tree: prompt 1 2 3 4 1 2 plus emitted 3 -> "1 2 3" seen before -> 4 1 2 (match 3)
    assert _step(proposer, {"a": ([1, 2, 3, 4, 1, 2], [3])}) == {"a": [4, 1, 2]}
    # "2 3 4 1" and "1 2 3 4 1" both give 2 3 4 1 at 1/2 each (score 2.0): the longer match wins the tie
    assert _step(proposer, {"a": ([1, 2, 3, 4, 1, 2, 3], [4, 1])}) == {"a": [2, 3, 4, 1]}
    proposer.request_done(DoneRequest("a", [1, 2, 3, 4, 1, 2, 3, 4, 1] + text, 9, None))  # its output goes to the global tree
    assert not proposer.requests and list(proposer.cache.outputs) == [text]
    # another request with another prompt: once it writes 10 11 12, the global tree continues the text
    assert _step(proposer, {"b": ([50, 51, 52], [10])}) == {"b": [11]}
    assert _step(proposer, {"b": ([50, 51, 52, 10], [11, 12])}) == {"b": [13, 14, 15]}
    # opting out of speculation: no tree, no drafts
    assert _step(proposer, {"c": ([10, 11, 12], [13])}, speculate=False) == {"c": []}
    assert set(proposer.requests) == {"b"}


def test_a_row_expected_to_verify_nothing_gets_no_drafts_but_its_tree_keeps_up():
    """The scheduler told 0 for a row: no walk, no drafts; the next step drafts as if the row had never been skipped."""
    told, never = _proposer(), _proposer()
    steps = [([1, 2, 3, 4, 1, 2], [3]), ([1, 2, 3, 4, 1, 2, 3], [4, 1]), ([1, 2, 3, 4, 1, 2, 3, 4, 1], [2])]
    for n, rows in enumerate(steps):
        skipped = n < 2
        got = _step(told, {"a": rows}, expected=0 if skipped else None)
        assert got == ({"a": []} if skipped else _step(never, {"a": rows})), n
        if skipped:
            _step(never, {"a": rows})
    assert told.requests["a"].tokens == never.requests["a"].tokens == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert got == {"a": [3, 4, 1, 2]}  # the last step drafted from the tokens of the skipped ones


def test_global_draft_replaces_the_own_only_with_a_higher_score():
    history = ([5, 6, 9, 5], [6])  # own tree: after "5 6" came 9 once (and the end): 9 5 at 1/2 each, score 1.0
    tied = _proposer()
    tied.request_done(DoneRequest("old", [0, 6, 7], 1, None))  # global: "6" -> 7 with probability 1, score 1.0 ("5 6" unseen)
    assert _step(tied, {"r": history}) == {"r": [9, 5]}  # a tie keeps the request's own draft
    better = _proposer()
    for _ in range(3):
        better.request_done(DoneRequest("old", [0, 5, 6, 7, 8], 1, None))  # global: "5 6" -> 7 8 with probability 1, score 2.0
    assert _step(better, {"r": history}) == {"r": [7, 8]}


def test_eviction_keeps_the_newest_outputs_and_bounds_the_tree():
    proposer = _proposer(suffix_decoding_max_cached_requests=3)
    rng = random.Random(0)
    outputs = [[rng.randrange(6) for _ in range(rng.randint(5, 40))] for _ in range(10)]
    sizes = []
    for i, output in enumerate(outputs):
        proposer.request_done(DoneRequest(f"r{i}", [1, 2] + output, 2, None))
        sizes.append(proposer.cache.tree.num_nodes)
    assert list(proposer.cache.outputs) == outputs[-3:]
    fresh = SuffixTree(24)
    for output in outputs[-3:]:
        fresh.writer().extend(output)
    assert proposer.cache.tree.num_nodes == fresh.num_nodes  # nothing of the evicted outputs is left
    assert proposer.cache.tree.root.count == sum(map(len, outputs[-3:]))
    assert max(sizes) <= 2 * sum(sorted(map(len, outputs), reverse=True)[:3]) + 1  # <= 2 nodes per cached token


# -- in the engine ------------------------------------------------------------------------------------------
def test_greedy_identical_at_batch_1_and_8_with_preemption_and_prefix_caching(target):
    prompts = [p + p for p in _prompts(8, seed=3)]  # 60 tokens each, repeated text
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=34, block_size=16, max_num_batched_tokens=64,
              speculative_config=SUFFIX)
    outs, preemptions = run_counting_preemptions(llm, prompts, params)
    assert _tokens(outs) == want and preemptions > 0 and _accepted(outs) > 0
    again = llm.generate(prompts[6:], params, use_tqdm=False)  # batch 2, prompts served by the prefix cache
    assert _tokens(again) == want[6:] and all(o.num_cached_tokens > 0 for o in again)
    assert _tokens(llm.generate(prompts[5:6], params, use_tqdm=False)) == want[5:6]  # batch 1
    assert not llm.engine.runner.proposer.requests  # every request ended and was dropped


def test_a_repeated_request_drafts_from_the_first_output(target):
    prompts = _prompts(3, seed=7)
    accepted = {}
    for cached in (10000, 0):  # 0: no global tree
        llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
                  speculative_config={**SUFFIX, "suffix_decoding_max_cached_requests": cached, "draft_row_cost": 0.0})
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _tokens(first) == _tokens(second)
        accepted[cached] = (_accepted(first), _accepted(second))
    assert accepted[0][0] == accepted[0][1] == accepted[10000][0]  # without a global tree, nothing is learned
    assert accepted[10000][1] >= 0.7 * 3 * 40 > accepted[10000][0]  # the repeat copies the first output


def test_aborted_requests_end_too(target):
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=SUFFIX)
    proposer = llm.engine.runner.proposer
    prompts = _prompts(3, seed=9)
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"q{i}", p, GREEDY)
    for _ in range(4):
        llm.engine.step()
    assert set(proposer.requests) == {"q0", "q1", "q2"}
    out = llm.engine.abort_request("q1")
    assert set(proposer.requests) == {"q0", "q2"}
    assert list(proposer.cache.outputs) == [out.outputs[0].token_ids] and out.outputs[0].token_ids
    llm.engine.abort_request("q0")
    llm.engine.abort_request("q2")
    assert not proposer.requests and len(proposer.cache.outputs) == 3


# -- the cache file -----------------------------------------------------------------------------------------
def test_cache_file_round_trip(target, tmp_path):
    path = tmp_path / "suffix.cache"
    prompts = _prompts(2, seed=11)
    config = {**SUFFIX, "suffix_decoding_cache_file": str(path), "draft_row_cost": 0.0}
    with LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=config) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert not path.exists()  # written at shutdown
    assert sorted(load_outputs(str(path), 320)) == sorted(_tokens(first))  # in the order they ended
    assert [p.name for p in tmp_path.iterdir()] == ["suffix.cache"]  # no temporary file left behind
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=config)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # a new engine drafts from the loaded outputs
    assert _tokens(again) == _tokens(first) and _accepted(again) >= 0.8 * 2 * 40 > _accepted(first)
    llm.close()
    assert sorted(load_outputs(str(path), 320)) == sorted(_tokens(first) * 2)


def test_bad_cache_file_is_refused_by_name(target, tmp_path):
    path = tmp_path / "cache.npz"
    config = {**SUFFIX, "suffix_decoding_cache_file": str(path)}
    path.write_bytes(b"not a cache")
    with pytest.raises(ValueError, match=f"'{path}' is not a suffix cache file"):
        LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=config)
    save_outputs(str(path), [[1, 2, 3]], vocab_size=1000)
    with pytest.raises(ValueError, match="written for a vocabulary of 1000 tokens, this model has 320"):
        LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=config)
    save_outputs(str(path), [[1, 2, 999]], vocab_size=320)
    with pytest.raises(ValueError, match="damaged"):
        LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, speculative_config=config)


# the saver: one import, then each line on stdin forks a process that prints its pid and saves version after
# version of a large cache until it is killed. On "rename" that process announces each rename of a finished
# temporary file ("renaming") and waits a second before it: a kill then always interrupts a save.
_SAVER = """
import os, sys, time
from eyas.spec_decode.suffix import save_outputs
path, rename = sys.argv[1], os.replace
def announced_rename(src, dst):
    print("renaming", flush=True)
    time.sleep(1.0)
    rename(src, dst)
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        if line.strip() == "rename":
            os.replace = announced_rename
        print(os.getpid(), flush=True)
        version = 1
        while True:
            save_outputs(path, [[version % 250] * 1000 for _ in range(2000)], 320)
            version += 1
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_cache_file_survives_kill_9_during_saving(tmp_path):
    """Kill -9 a saving process just before a rename, and at random moments: the file on disk is always one
    whole version, the old one or a new one."""
    path = tmp_path / "cache.npz"
    old = [[255] * 5] * 3
    save_outputs(str(path), old, 320)
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in saver.stdout], daemon=True).start()
    rng = random.Random(0)
    try:
        assert lines.get(timeout=120) == "ready"
        for trial in ["rename"] * 3 + ["random"] * 8:
            saver.stdin.write(f"{trial}\n")
            saver.stdin.flush()
            pid = int(lines.get(timeout=60))
            if trial == "rename":  # the temporary file is complete, the rename has not happened
                assert lines.get(timeout=60) == "renaming"
            else:
                time.sleep(rng.uniform(0.0, 0.6))
            os.kill(pid, signal.SIGKILL)
            while lines.get(timeout=60) != "reaped":  # "renaming" lines that raced the kill
                pass
            outputs = load_outputs(str(path), 320)  # raises on a torn file
            assert outputs == old or outputs == [[outputs[0][0]] * 1000] * 2000
            leftovers = [p for p in tmp_path.iterdir() if p != path]
            assert leftovers or trial == "random"  # a save in flight writes elsewhere than the file
            for p in leftovers:
                p.unlink()
    finally:
        saver.kill()
        saver.wait()
