"""Speculative decoding is lossless: outputs equal non-speculative outputs; metrics are exact."""

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.spec_decode import registry
from eyas.spec_decode.proposer import Proposer, ProposerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)


def _prompts(n=8, seed=3, repeat=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(0, 256, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        out.append(p + p if repeat else p)  # repeated text gives the n-gram matcher something to find
    return out


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("spec")
    return {"target": make_tiny_model(root / "target", "llama", num_hidden_layers=4),
            "draft": make_tiny_model(root / "draft", "qwen3", seed=5, num_hidden_layers=1)}


SHARED = {"verification": "shared_noise"}  # token-identical seeded output
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **SHARED},
    "suffix": {"method": "suffix", **SHARED},  # k: the longest draft the default trees allow (12)
    "self_draft": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2, **SHARED},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT", **SHARED},
}


def _spec_config(name, spec_models, **over):
    cfg = dict(METHODS[name])
    if cfg.get("model") == "DRAFT":
        cfg["model"] = str(spec_models["draft"])
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("method", list(METHODS))
def test_speculative_equals_plain_greedy_and_seeded(spec_models, method):
    target = str(spec_models["target"])
    prompts = _prompts()
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    ref_greedy = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    ref_seeded = _tokens(plain.generate(prompts, SEEDED, use_tqdm=False))
    settings = [dict(kv_cache_gb=0.02),  # batch 8 with prefix caching on
                dict(num_kv_blocks=28, max_num_batched_tokens=32, block_size=8 * 2),  # preemption + chunking
                dict(kv_cache_gb=0.02, block_size=8)]  # drafts crossing many block boundaries
    for kw in settings:
        llm = LLM(target, dtype="float32", max_model_len=256, speculative_config=_spec_config(method, spec_models), **kw)
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref_greedy
        assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == ref_greedy[:1]  # batch 1
        assert _tokens(llm.generate(prompts, SEEDED, use_tqdm=False)) == ref_seeded  # shared-noise matching
        assert llm.stats()["num_drafted"] > 0
        # nothing leaks once every request finished: no tables, no referenced blocks, all blocks free
        assert not llm.engine.kv.tables
        assert all(sum(pool.ref_counts) == 0 and pool.num_free == pool.num_blocks - 1 for pool in llm.engine.kv.pools)


def test_rejection_mode_keeps_greedy_and_counts(spec_models):
    target = str(spec_models["target"])
    prompts = _prompts(4)
    ref = _tokens(LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02).generate(prompts, GREEDY,
                                                                                               use_tqdm=False))
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
              speculative_config=_spec_config("draft_model", spec_models, verification="rejection"))
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    outs = llm.generate(prompts, SEEDED, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)


def test_draft_model_identical_to_target_accepts_everything(spec_models):
    """A draft model equal to the target proposes the target's own tokens: with greedy and with
    shared noise every draft is accepted, which only holds if the draft's catch-up cache, positions
    and noise keys line up exactly with the target's."""
    target = str(spec_models["target"])
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, max_num_batched_tokens=24,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": target,
                                  "draft_row_cost": 0.0, **SHARED})  # all 4 requests verify 3 drafts
    for params in (GREEDY, SEEDED):
        outs = llm.generate(_prompts(4, repeat=False), params, use_tqdm=False)
        for o in outs:
            m = o.spec_metrics
            assert m["acceptance_rate"] == 1.0 and m["per_position_acceptance"] == [1.0, 1.0, 1.0], m
            assert m["num_drafted"] >= 27  # 40 tokens: 1 from the prefill, then steps of 4 (the last cut short)


def test_mixed_batch_with_opt_out_and_prefills(spec_models):
    target = str(spec_models["target"])
    prompts = _prompts(6)
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculate=False)] * 3
    ref = _tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02, max_num_batched_tokens=40,
              speculative_config=_spec_config("ngram", spec_models))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == ref
    assert all(o.spec_metrics["num_drafted"] == 0 for o in outs[1::2])  # opted out
    assert sum(o.spec_metrics["num_drafted"] for o in outs[0::2]) > 0


def test_verification_computes_logits_of_verified_positions_only_and_keeps_logprobs(spec_models, monkeypatch):
    """Each step computes logits for every sampling request's last token plus its drafts (R + sum of
    drafts rows, not R * (k + 1) padded rows), and the logprobs of the emitted tokens are those of
    plain decoding."""
    target = str(spec_models["target"])
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculate=False)] * 3
    ref = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
              speculative_config=_spec_config("ngram", spec_models))
    runner = llm.engine.runner
    rows, verified = [], []
    compute_logits, execute = runner.model.compute_logits, runner.execute
    monkeypatch.setattr(runner.model, "compute_logits", lambda hidden: rows.append(len(hidden)) or compute_logits(hidden))

    def counting_execute(plan):
        sampling = [len(e.draft_token_ids) for e in plan.scheduled if e.will_sample]
        if sampling:
            verified.append((len(sampling), sum(sampling), max(sampling)))
        return execute(plan)

    monkeypatch.setattr(runner, "execute", counting_execute)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == _tokens(ref)
    assert rows == [n + drafts for n, drafts, _ in verified]
    assert any(drafts and n * (longest + 1) > n + drafts for n, drafts, longest in verified)  # padding was saved
    for got, want in zip(outs[0::2], ref[0::2]):
        for lp, lp_ref in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert lp.keys() == lp_ref.keys()
            assert list(lp.values()) == pytest.approx(list(lp_ref.values()), abs=1e-4)


class OracleProposer(Proposer):
    """Drafts [true, true, wrong] continuations of the reference output: exactly 2 of 3 accepted."""

    method = "oracle"
    reference: dict = {}

    def __init__(self, spec, config, target):
        self.k = spec.num_speculative_tokens

    def propose(self, inp):
        rows, counts = [], []
        emitted, num = inp.emitted.tolist(), inp.num_emitted.tolist()
        for r, history in enumerate(inp.token_ids):
            full = history + emitted[r][:num[r]]
            ref = next(v for key, v in self.reference.items() if full[:len(key)] == list(key))
            start = len(full) - len(next(key for key in self.reference if full[:len(key)] == list(key)))
            true = ref[start:start + 2]
            rows.append(true + [(ref[start + 2] + 1) % 256 if start + 2 < len(ref) else 0])
            counts.append(3 if len(true) == 2 else 0)
        return ProposerOutput(torch.tensor(rows, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))


def test_metrics_are_exact_on_a_constructed_case(spec_models, monkeypatch):
    target = str(spec_models["target"])
    prompts = _prompts(2, repeat=False)
    params = SamplingParams(temperature=0, max_tokens=31, ignore_eos=True)
    ref = _tokens(LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02).generate(prompts, params,
                                                                                               use_tqdm=False))
    monkeypatch.setitem(registry.PROPOSERS, "oracle", (__name__, "OracleProposer"))
    OracleProposer.reference = {tuple(p): r for p, r in zip(prompts, ref)}
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
              speculative_config={"method": "oracle", "num_speculative_tokens": 3, "adaptive_draft_length": False})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == ref
    # 31 tokens: the prefill emits 1; steps 1-9 verify [true, true, wrong], accept 2, emit 3 (-> 28);
    # step 10 has room for 3 more tokens, so only 2 drafts are verified, both accepted (-> 31).
    # drafted 9*3 + 2 = 29, accepted 10*2 = 20, acceptance length (20 + 10) / 10 = 3.0
    for o in outs:
        m = o.spec_metrics
        assert m["num_steps"] == 10 and m["num_drafted"] == 29 and m["num_accepted"] == 20
        assert m["mean_acceptance_length"] == 3.0 and m["per_position_acceptance"] == [1.0, 1.0, 0.0]
    totals = llm.stats()
    assert totals["num_drafted"] == 58 and totals["num_accepted"] == 40


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method: 'eagle9' is not one of draft_model, "),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens: 0 must be an int in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens: 17"),
    ({"method": "ngram"}, "num_speculative_tokens: missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verification": "magic"}, "verification: 'magic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "colour": 1}, r"unknown key\(s\) \['colour'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min/max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_step_cost": -1}, "draft_step_cost: -1 must be a number >= 0"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs exactly one of 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 9}, "draft_num_layers: 9 must be below"),
])
def test_bad_speculative_config(spec_models, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(spec_models["target"]), max_model_len=256, kv_cache_gb=0.02, speculative_config=config)


def test_draft_model_with_other_vocabulary_is_refused(spec_models, tmp_path):
    from tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=400, num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft vocabulary size 400 differs from the target's 320"):
        LLM(str(spec_models["target"]), max_model_len=256, kv_cache_gb=0.02,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(other)})


def test_adaptive_draft_budget_follows_the_documented_example():
    from eyas.spec_decode.adaptive import DraftBudget

    b = DraftBudget.start(4)
    seen = []
    for drafted, accepted in [(4, 4), (4, 2), (4, 1), (3, 0), (2, 0), (1, 1)]:
        assert b.limit == drafted
        b.update(drafted, accepted)
        seen.append(b.limit)
    assert seen == [4, 4, 3, 2, 1, 3]


def test_acceptance_estimate_is_decayed_accepted_over_accepted_plus_rejections():
    from eyas.spec_decode.adaptive import DraftBudget

    b = DraftBudget.start(8)
    assert b.acceptance() == 0.5  # the prior alone
    b.update(8, 8)  # 8 accepted, no rejection
    assert b.acceptance() == pytest.approx((8 + 1) / (8 + 2))
    b.update(4, 1)  # 1 accepted, then a rejection; the first verification weighs 0.9
    assert b.acceptance() == pytest.approx((0.9 * 8 + 1 + 1) / (0.9 * 8 + 1 + 1 + 2))
    b.update(0, 0)  # nothing verified: no new evidence, the old fades toward the prior
    accepted, rejections = 0.9 * (0.9 * 8 + 1), 0.9 * 1
    assert b.acceptance() == pytest.approx((accepted + 1) / (accepted + rejections + 2))


def test_after_a_miss_drafts_are_priced_by_what_followed_earlier_misses():
    """Two estimates: verifications after an accepted draft and after a verification that accepted none
    each count toward their own, and the request's last verification picks the one its drafts are priced by."""
    from eyas.spec_decode.adaptive import DraftBudget

    b = DraftBudget.start(1)
    b.update(1, 1)  # first verification (after-hit state): accepted
    b.update(1, 0)  # after a hit: rejected -> now in the after-miss state, which has no evidence yet
    assert b.missed and b.acceptance() == 0.5
    b.update(1, 0)  # after a miss: rejected
    b.update(1, 0)  # after a miss: rejected
    assert b.acceptance() == pytest.approx(1 / (0.9 + 1 + 2))  # 0 accepted, 1.9 rejections after misses
    b.update(1, 1)  # after a miss: accepted -> back to the after-hit state
    assert not b.missed
    assert b.acceptance() == pytest.approx((0.9 ** 4 + 1) / (0.9 ** 4 + 0.9 ** 3 + 2))  # 1 accepted, 1 rejected
    assert b.after_miss.estimate() == pytest.approx((1 + 1) / (1 + 0.9 * 1.9 + 2))


def test_budget_peek_is_the_next_limit_and_estimate_without_side_effects():
    import copy

    from eyas.spec_decode.adaptive import DraftBudget

    b = DraftBudget.start(4)
    peeked = []
    for accepted in [1, 0, 0, 0, 0, 0, 0, 1]:
        drafted = b.limit  # this step's schedule
        before = copy.deepcopy(b)
        peeked.append(b.peek())
        assert b == before  # nothing changed
        quiet = copy.deepcopy(b)
        quiet.update(0, 0)  # had this step verified nothing, the next step would see:
        assert peeked[-1] == (quiet.limit, quiet.acceptance())
        b.update(drafted, min(drafted, accepted))
    assert [n for n, _ in peeked] == [4, 3, 2, 1, 1, 1, 1, 1]
    # from the third step on, the request is priced by what followed its misses
    assert peeked[2][1] == pytest.approx(0.5) and peeked[6][1] < 0.25


def test_a_request_the_cost_model_skips_is_retried_as_its_evidence_fades():
    """The documented example: at 8 decoding rows (c = 0.07) a request at 0.29 gets no draft; after 10 steps
    without drafts its estimate is back at 0.36 and its first draft is verified again."""
    from eyas.spec_decode.adaptive import DraftBudget, Evidence, RowCost, allocate_drafts

    b = DraftBudget(k=4, limit=4, after_hit=Evidence(accepted=1.0, rejections=4.0))
    others = [(4, 0.2, 0)] * 7
    waited = 0
    while allocate_drafts([(b.peek()[0], b.peek()[1], 0)] + others, 8, RowCost.linear(0.07), 64)[0] == 0:
        b.update(0, 0)
        waited += 1
    assert waited == 9 and b.peek()[1] == pytest.approx(0.36, abs=0.005)


def test_draft_allocation_follows_the_documented_examples():
    from eyas.spec_decode.adaptive import DraftCost, RowCost, allocate_drafts

    line = RowCost.linear

    assert allocate_drafts([(8, 0.85, 0)], num_rows=1, cost=line(0.05), max_drafts=64) == [8]
    assert allocate_drafts([(8, 0.5, 0)] * 8, num_rows=8, cost=line(0.05), max_drafts=64) == [1] * 8
    assert allocate_drafts([(8, 0.5, 0)] * 8, num_rows=8, cost=line(0.0), max_drafts=64) == [8] * 8  # CUDA: all
    # best drafts first: the 0.95 request's two (0.95, 0.90) and 0.5's first two (0.5, 0.25) beat
    # the 0.5 request's third (0.125); a request offering none gets none; the budget caps the total
    assert allocate_drafts([(3, 0.5, 0), (0, 0.9, 0), (2, 0.95, 0)], num_rows=3, cost=line(0.05), max_drafts=64) == [2, 0, 2]
    assert allocate_drafts([(3, 0.5, 0), (0, 0.9, 0), (2, 0.95, 0)], num_rows=3, cost=line(0.05), max_drafts=3) == [1, 0, 2]
    # a long prompt chunk in the same forward makes drafts cheap relative to the step
    assert allocate_drafts([(8, 0.5, 0)] * 8, num_rows=8 + 512, cost=line(0.05), max_drafts=64) == [5] * 8
    # drafts forced by a grammar are certain: 8 requests at 0.5 verify their 3 forced drafts (where they would
    # verify 1 without); then the 4th, worth 0.5, no longer covers its row (0.5 * (1 + 0.05 * 32) < 0.05 * 32)
    assert allocate_drafts([(8, 0.5, 3)] * 8, num_rows=8, cost=line(0.05), max_drafts=64) == [3] * 8
    # a drafter whose step costs s = 0.35 of a one-row forward: drafts must pay for it too (k = 1)
    assert allocate_drafts([(1, 0.5, 0)], num_rows=1, cost=line(0.07), max_drafts=64, step_cost=DraftCost(0.35)) == [1]
    assert allocate_drafts([(1, 0.36, 0)], num_rows=1, cost=line(0.07), max_drafts=64, step_cost=DraftCost(0.35)) == [0]
    assert allocate_drafts([(1, 0.5, 0)] * 14, num_rows=14, cost=line(0.07), max_drafts=64, step_cost=DraftCost(0.35)) == [0] * 14
    assert allocate_drafts([(1, 0.5, 0)] * 4, num_rows=4, cost=line(0.07), max_drafts=64, step_cost=DraftCost(0.35)) == [1] * 4
    # a draft forced by a grammar needs no drafter: at batch 16 it is verified, the drafter's 0.3 after it is not
    assert allocate_drafts([(4, 0.3, 1)] + [(0, 0.5, 0)] * 15, num_rows=16, cost=line(0.07), max_drafts=64,
                           step_cost=DraftCost(0.35)) == [1] + [0] * 15


def test_draft_allocation_looks_past_a_jump_in_the_row_cost():
    """An earlier kernel's GGUF curve: a 5th row costs 0.60 of a forward after 0.12 for the 4th, so a 4th draft
    alone never pays; at acceptance 0.95 all 8 drafts do (7.40 tokens for 2.70 beat 3.71 for 1.47), at 0.90 not."""
    from eyas.spec_decode.adaptive import DraftCost, RowCost, allocate_drafts

    gguf = RowCost(((1, 1.0), (2, 1.12), (3, 1.35), (4, 1.47), (5, 2.07), (6, 2.18), (8, 2.53), (10, 2.87)))
    assert allocate_drafts([(8, 0.95, 0)], num_rows=1, cost=gguf, max_drafts=64) == [8]
    assert allocate_drafts([(8, 0.90, 0)], num_rows=1, cost=gguf, max_drafts=64) == [3]
    assert allocate_drafts([(8, 0.95, 0)], num_rows=1, cost=gguf, max_drafts=5) == [3]  # 5 do not clear the jump
    # the drafter's step is paid once: with s = 0.2 the same request still takes all 8
    assert allocate_drafts([(8, 0.95, 0)], num_rows=1, cost=gguf, max_drafts=64, step_cost=DraftCost(0.2)) == [8]


# the shipped EAGLE-3 drafter's products and the GGUF target's at "low", one thread (Emerald Rapids Xeon)
DRAFTER_PRODUCTS = ((1, 0.052), (2, 0.065), (4, 0.085), (8, 0.149), (16, 0.254), (32, 0.48))
LOW_ROWS = ((1, 1.0), (2, 1.07), (4, 1.22), (8, 1.64), (16, 2.89))


def test_draft_cost_grows_with_the_requests_drafted_for():
    """DraftCost's formulas, written out here: fixed + d base + P(2r) - P(2) + (d - 1) (P(r) - P(1)) for a chain
    drafter (a pass a draft), fixed + (1 + [d > 1]) base + P(2r) - P(2) + P((d - 1) r) - P(d - 1) for a parallel one
    (the prefill, then one forward of mask rows); nothing when no request drafts; a flat figure for any step that
    drafts."""
    from eyas.spec_decode.adaptive import DraftCost, RowCost

    p = RowCost(DRAFTER_PRODUCTS)
    chain, parallel, flat = DraftCost(0.15, p), DraftCost(0.15, p, parallel=True), DraftCost(0.15)
    assert chain(0, 3) == parallel(0, 3) == flat(0, 2) == chain(2, 0) == 0.0
    for depth in (1, 2, 4):  # one request: a timed batch-1 pass per pass
        assert chain(1, depth) == pytest.approx(0.15 * depth)
        assert parallel(1, depth) == pytest.approx(0.15 if depth == 1 else 0.30)
    assert chain(8, 1) == pytest.approx(0.15 + 0.254 - 0.065)  # the docstring's example
    assert chain(8, 3) == pytest.approx(0.15 + 0.254 - 0.065 + 2 * (0.15 + 0.149 - 0.052))
    assert parallel(8, 3) == pytest.approx(0.30 + 0.254 - 0.065 + 0.254 - 0.065)  # 16 mask rows, one pass
    assert chain(3, 2) == pytest.approx(0.30 + (0.085 + 0.149) / 2 - 0.065 + (0.065 + 0.085) / 2 - 0.052)
    assert flat(16, 4) == 0.15
    # a fixed part, paid once by a step that drafts: s(1, d) = fixed + d base
    fixed = DraftCost(0.18, p, fixed=0.18)
    assert fixed(0, 3) == fixed(2, 0) == 0.0
    assert [fixed(1, d) for d in (1, 3)] == pytest.approx([0.36, 0.72])
    assert fixed(8, 3) == pytest.approx(chain(8, 3) + 0.18 + 3 * 0.03)


def test_a_drafter_that_costs_more_at_batch_8_drafts_less_there():
    """8 requests at acceptance 0.9 offering 3 drafts: with the flat 0.15 they verify 2 each (21.7 tokens for
    4.14 + 0.15 beat 8 for 1.64), with the cost grown to 8 requests none. At batch 1 both verify 3 (3.44 tokens
    for 1.22 + 0.45 with the grown cost); at batch 4 the flat cost takes 3 each, the grown one 1 each (7.6 tokens
    for 1.64 + 0.234 beat 10.84 for 2.265 + 0.417 and 13.76 for 2.89 + 0.60: every pass of the chain costs)."""
    from eyas.spec_decode.adaptive import DraftCost, RowCost, allocate_drafts

    target, p = RowCost(LOW_ROWS), RowCost(DRAFTER_PRODUCTS)
    flat, grown = DraftCost(0.15), DraftCost(0.15, p)
    assert allocate_drafts([(3, 0.9, 0)] * 8, 8, target, 64, flat) == [2] * 8
    assert allocate_drafts([(3, 0.9, 0)] * 8, 8, target, 64, grown) == [0] * 8
    assert allocate_drafts([(3, 0.9, 0)], 1, target, 64, flat) == allocate_drafts([(3, 0.9, 0)], 1, target, 64,
                                                                                   grown) == [3]
    assert allocate_drafts([(3, 0.9, 0)] * 4, 4, target, 64, flat) == [3] * 4
    assert allocate_drafts([(3, 0.9, 0)] * 4, 4, target, 64, grown) == [1] * 4


def test_adaptive_drafting_backs_off_when_drafts_are_useless(spec_models, monkeypatch):
    """A proposer that is always wrong costs few verified drafts with the adaptive policy. With rows at 0.1 of a
    one-row forward (as the quantized CPU kernels' are) and 2 decoding requests, a first draft must be worth
    1/6 of a token, so a request retries only while its estimate after misses, 1 / (2 + r), has r <= 4 faded
    rejections; they fade 0.1 x 4 = 0.4 a step, so at most about 0.4 one-draft retries a step, once the first
    verifications have shrunk its limit from 4 to 1."""
    monkeypatch.setitem(registry.PROPOSERS, "wrong", (__name__, "WrongProposer"))
    prompts = _prompts(2, repeat=False)
    counts = {}
    for adaptive in (False, True):
        llm = LLM(str(spec_models["target"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02,
                  speculative_config={"method": "wrong", "num_speculative_tokens": 4, "draft_row_cost": 0.1,
                                      "adaptive_draft_length": adaptive})
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        counts[adaptive] = llm.stats()["num_drafted"]
    assert counts[False] > 4 * 60 and counts[True] <= 2 * (0.45 * 64 + 4 + 3 + 2 + 1)


class WrongProposer(Proposer):
    method = "wrong"

    def __init__(self, spec, config, target):
        self.k = spec.num_speculative_tokens

    def propose(self, inp):
        rows = len(inp.token_ids)
        last = torch.tensor([t[-1] for t in inp.token_ids], dtype=torch.int64) if rows else torch.zeros(0)
        drafts = ((last[:, None] + 1 + torch.arange(self.k)) % 7 + 300).to(torch.int64)  # ids the model never picks
        return ProposerOutput(drafts, torch.full((rows,), self.k, dtype=torch.int64))



@pytest.mark.parametrize("method", list(METHODS))
def test_penalties_stay_lossless_under_speculation(spec_models, method):
    """Each verify row counts the drafts before it: greedy and shared-noise seeded outputs equal plain ones."""
    target = str(spec_models["target"])
    prompts = _prompts()
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1, logit_bias={5: 1.5})
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalties)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True, **penalties)
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    want_greedy, want_seeded = (_tokens(plain.generate(prompts, p, use_tqdm=False)) for p in (greedy, seeded))
    assert want_greedy != _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
              speculative_config=_spec_config(method, spec_models))
    assert _tokens(llm.generate(prompts, greedy, use_tqdm=False)) == want_greedy
    assert _tokens(llm.generate(prompts, seeded, use_tqdm=False)) == want_seeded
    assert llm.stats()["num_accepted"] > 0


def test_a_stop_string_ends_speculative_output_where_it_ends_plain_output(spec_models):
    """A verification may commit tokens past the one completing a stop string; they go, with their logprobs, so
    tokens, text, finish and stop reasons equal decoding a token a step. A stop string completed by the token
    max_tokens allows ends the output as "stop", as it does a token earlier."""
    target = str(spec_models["target"])
    plain = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    spec = LLM(target, dtype="float32", max_model_len=256, kv_cache_gb=0.02,
               speculative_config=_spec_config("ngram", spec_models))
    prompts = _prompts(4)
    texts = [o.outputs[0].text for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    cases = [(p, t[i:i + 2]) for p, t in zip(prompts, texts) for i in (5, 11, 17) if len(t[i:i + 2]) == 2]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s], logprobs=0) for _, s in cases]
    want = plain.generate([p for p, _ in cases], params, use_tqdm=False)
    got = spec.generate([p for p, _ in cases], params, use_tqdm=False)
    assert sum(o.spec_metrics["num_accepted"] for o in got) > 0
    for (_, stop), w, g in zip(cases, want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, "stop", stop)
        assert len(g.logprobs) == len(g.from_draft) == len(g.token_ids)
    # the stop string completed by the last token max_tokens allows
    (prompt, stop), first = cases[0], want[0].outputs[0]
    for llm in (plain, spec):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(first.token_ids), ignore_eos=True,
                                                    stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (first.token_ids, "stop", stop)
