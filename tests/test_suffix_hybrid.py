"""Suffix decoding in front of a model drafter (``enable_suffix_decoding``): the options, the per-request rule
(a suffix draft scoring at least k is taken and the drafter skips that request), the merged draft
probabilities, and lossless output in the engine with EAGLE-3 and MTP drafters."""

from types import SimpleNamespace

import pytest
import torch
from conftest import K
from engine_helpers import host_input, run_counting_preemptions

from eyas import LLM, SamplingParams
from eyas.spec_decode.config import SpeculativeConfig
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput
from eyas.spec_decode.suffix import SuffixProposer
from eyas.spec_decode.suffix_hybrid import SuffixHybrid

CPU = SimpleNamespace(device=torch.device("cpu"))


# -- options ---------------------------------------------------------------------------------------------
def test_lookahead_is_the_longer_of_k_and_the_longest_suffix_draft(drafters):
    folder = drafters.folders["eagle3"]
    base = {"method": "eagle3", "model": folder, "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(base).max_drafts == 2
    on = SpeculativeConfig.from_dict({**base, "enable_suffix_decoding": True})
    [(name, options)] = on.wrappers
    assert on.max_drafts == 12 and name == "suffix_hybrid" and options.longest_draft() == 12
    short = SpeculativeConfig.from_dict({**base, "num_speculative_tokens": 6, "enable_suffix_decoding": True,
                                         "suffix_decoding_max_tree_depth": 8})
    assert short.max_drafts == 6 and short.wrappers[0][1].longest_draft() == 4


@pytest.mark.parametrize(("over", "message"), [
    ({"suffix_decoding_max_tree_depth": 8}, "reads it only with enable_suffix_decoding: true"),
    ({"enable_suffix_decoding": True, "suffix_decoding_max_tree_depth": 0}, "max_tree_depth: 0 must be an int >= 1"),
    ({"enable_suffix_decoding": "yes"}, "enable_suffix_decoding: 'yes' must be true or false"),
    ({"method": "ngram", "model": None, "enable_suffix_decoding": True}, "not used by method 'ngram'"),
])
def test_bad_suffix_options_on_a_model_drafter_are_refused(drafters, over, message):
    spec = {"method": "eagle3", "model": drafters.folders["eagle3"], "num_speculative_tokens": 2, **over}
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({k: v for k, v in spec.items() if v is not None})


# -- the rule ------------------------------------------------------------------------------------------
class _Drafter(Proposer):
    """A model drafter stand-in: drafts token 99 k times for every row it is not told 0, and records what it was told."""

    method = "fake"

    def __init__(self, k: int, vocab: int | None = None):
        self.k, self.vocab, self.told = k, vocab, []

    def propose(self, inp: ProposerInput) -> ProposerOutput:
        self.told.append(list(inp.expected_drafts))
        n = torch.tensor([self.k if e > 0 else 0 for e in inp.expected_drafts])
        probs = None
        if self.vocab is not None:
            probs = torch.full((len(n), self.k, self.vocab), 1.0 / self.vocab)
        return ProposerOutput(torch.full((len(n), self.k), 99), n, probs)


def _hybrid(k: int, vocab: int | None = None) -> SuffixHybrid:
    spec = SpeculativeConfig.from_dict({"method": "suffix"})
    return SuffixHybrid(_Drafter(k, vocab), SuffixProposer(spec, CPU, None), k)


def _input(rows: dict[str, list[int]], width: int) -> ProposerInput:
    """Each request's committed tokens, with its last token as this step's emitted one."""
    return host_input({i: (tokens[:-1], tokens[-1:]) for i, tokens in rows.items()}, width)


# "a": 1..6 seen twice, then 1 2 3: suffix decoding continues 4 5 6 with probability 1 each (score 3)
# "b": 7 8 was followed once by 9 and once by 10 -> [9] or [10] at probability 1/2 (score 0.5)
# "c": no repeat, no suffix draft
ROWS = {"a": [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], "b": [7, 8, 9, 7, 8, 10, 7, 8], "c": [20, 21, 22]}


def test_a_request_takes_the_suffix_draft_where_it_scores_k_or_more_and_the_drafter_skips_it():
    hybrid = _hybrid(k=1)
    out = hybrid.propose(_input(ROWS, 12))
    counts = out.num_drafts.tolist()
    assert out.draft_token_ids[0, :counts[0]].tolist()[:3] == [4, 5, 6]  # score >= 1: suffix decoding's draft
    assert out.draft_token_ids[1, :counts[1]].tolist() == [99]  # score 0.5 < 1: the drafter's
    assert out.draft_token_ids[2, :counts[2]].tolist() == [99]  # no suffix draft: the drafter's
    assert hybrid.drafter.told == [[0, 12, 12]]
    assert out.draft_probs is None  # the drafter's drafts came without probabilities
    assert (hybrid.suffix_rows, hybrid.drafter_rows) == (1, 2)
    # with k = 4 the same 3-token draft of "a" (score 3 < 4) goes to the drafter as well
    hybrid = _hybrid(k=4)
    out = hybrid.propose(_input(ROWS, 12))
    assert out.num_drafts.tolist() == [4, 4, 4] and (out.draft_token_ids[:, :4] == 99).all()
    assert hybrid.drafter.told == [[12, 12, 12]]


def test_sampled_drafter_rows_keep_their_probabilities_and_suffix_rows_become_one_hot():
    hybrid = _hybrid(k=1, vocab=32)
    out = hybrid.propose(_input(ROWS, 12))
    n = out.num_drafts.tolist()
    assert out.draft_probs.shape == (3, n[0], 32) and n[0] >= 3
    suffix_row = out.draft_probs[0, :n[0]]
    assert torch.equal(suffix_row.argmax(-1), out.draft_token_ids[0, :n[0]]) and torch.equal(suffix_row.sum(-1),
                                                                                              torch.ones(n[0]))
    assert torch.equal(suffix_row.max(-1).values, torch.ones(n[0]))
    assert torch.allclose(out.draft_probs[1:, 0], torch.full((2, 32), 1 / 32))


# -- in the engine ---------------------------------------------------------------------------------------
def _llm(drafters, case: str, **spec_over):
    method, folder = {"eagle3": ("eagle3", drafters.folders["eagle3"]), "mtp_1": ("mtp", drafters.folders["mtp_1"])}[case]
    spec = {"method": method, "num_speculative_tokens": K, "enable_suffix_decoding": True,
            "draft_row_cost": 0.0, "draft_step_cost": 0.0, **spec_over}
    if method != "mtp":
        spec["model"] = folder
    target = folder if method == "mtp" else str(drafters.target)
    return target, dict(dtype="float32", max_model_len=256, kv_cache_gb=0.05, speculative_config=spec)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random token runs, each repeated: suffix decoding finds the repeats, the drafter the rest."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (m,), generator=g).tolist() * 3 for m in (4, 9, 6, 12, 3, 7, 10, 5)[:n]]


@pytest.mark.parametrize("case", ["eagle3", "mtp_1"])
def test_greedy_output_equals_plain_batch_1_and_8_with_preemption(drafters, case):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    target, kw = _llm(drafters, case)
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    prompts = _prompts(8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    alone = LLM(target, **kw)
    assert [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:3]] == want[:3]
    tight = LLM(target, **{**kw, "num_kv_blocks": 24, "max_num_batched_tokens": 48})  # preemption + chunked prefill
    outs, preemptions = run_counting_preemptions(tight, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want and preemptions > 0
    for llm in (alone, tight):
        proposer = llm.engine.runner.proposer
        assert proposer.suffix_rows > 0 and proposer.drafter_rows > 0
        assert llm.stats()["num_accepted"] > 0


def test_every_draft_verified_and_seeded_sampling_with_shared_noise_stay_lossless(drafters):
    target, kw = _llm(drafters, "eagle3", adaptive_draft_length=False, verification="shared_noise",
                      num_speculative_tokens=1)  # a suffix draft scoring 1 is taken
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True) for t, s in ((0, 0), (0.7, 1), (1.0, 2))]
    prompts = _prompts(3, seed=3)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(target, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.runner.proposer.suffix_rows > 0
