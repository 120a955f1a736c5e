"""Preemption, chunked prefill and prefix caching never change outputs; seeded sampling is batch-invariant."""

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.model.quantized import kernel_available

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _llm(path, **kw):
    kw.setdefault("kv_cache_gb", 0.02)
    return LLM(str(path), dtype="float32", max_model_len=256, **kw)


def test_preemption_chunked_prefill_and_prefix_cache_keep_greedy_outputs(tiny_models):
    path = tiny_models["llama"]
    prompts = _prompts()
    reference = _tokens(_llm(path, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False))

    tiny_pool = _llm(path, num_kv_blocks=20, enable_prefix_caching=False)  # 19 usable blocks = 304 slots
    outs = tiny_pool.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == reference

    chunked = _llm(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == reference

    cached = _llm(path)
    shared = list(range(40, 120))  # 80-token shared prefix = 5 full blocks
    with_prefix = [shared + p for p in prompts]
    first = cached.generate(with_prefix[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(with_prefix, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 80 for o in rest)
    fresh = _llm(path, enable_prefix_caching=False).generate(with_prefix, GREEDY, use_tqdm=False)
    assert _tokens(rest) == _tokens(fresh) and _tokens(first) == _tokens(fresh[:1])


def test_preemption_really_happens(tiny_models):
    llm = _llm(tiny_models["llama"], num_kv_blocks=20, enable_prefix_caching=False)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    preempted = 0
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        preempted += len(plan.preempted)
        if plan.scheduled:
            engine.scheduler.commit(plan, engine.runner.execute(plan))
    assert preempted > 0
    assert engine.kv.num_free_blocks == 19  # every block came back


def test_seeded_sampling_is_identical_alone_and_in_a_mixed_batch(tiny_models):
    llm = _llm(tiny_models["qwen3"])
    prompts = _prompts(6, seed=7)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=30, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [seeded] + [SamplingParams(temperature=t, seed=None, max_tokens=20 + 3 * i, ignore_eos=True)
                               for i, t in enumerate([0, 0.5, 1.0, 1.3, 0.7])]
    mixed = llm.generate(prompts, mixed_params, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    # the same seed in another slot of another batch, after preemption and chunking, still matches
    other = _llm(tiny_models["qwen3"], num_kv_blocks=18, max_num_batched_tokens=16, enable_prefix_caching=False)
    again = other.generate(prompts[::-1], [mixed_params[i] for i in range(5, -1, -1)], use_tqdm=False)
    assert again[-1].outputs[0].token_ids == alone
    # unseeded requests differ from each other (the engine draws a fresh seed per request)
    free = llm.generate([prompts[1]] * 2, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert free[0].outputs[0].token_ids != free[1].outputs[0].token_ids


def test_stop_conditions_and_outputs(tiny_models):
    llm = _llm(tiny_models["llama"])
    prompt = _prompts(1)[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = base.text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    if stop_str:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "stop" and stop_str not in out.outputs[0].text
        assert text.startswith(out.outputs[0].text)
        kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert kept.text == out.outputs[0].text + stop_str and kept.token_ids == out.outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 7 and len(c.logprobs) == 7
    assert all(t in lp and len(lp) >= 3 for t, lp in zip(c.token_ids, c.logprobs))
    assert all(max(lp.values()) == lp[t] for t, lp in zip(c.token_ids, c.logprobs))  # greedy = top-1
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    assert c.cumulative_logprob < 0 and base.cumulative_logprob is None  # none without logprobs
    m = out.metrics
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0


def test_max_tokens_none_runs_to_max_model_len(tiny_models):
    """As vLLM: max_tokens=None lets an output run until prompt and output fill max_model_len."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, kv_cache_gb=0.02)
    out = llm.generate([list(range(5, 15))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 64 - 10 and out.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_models):
    """vLLM's truncate_prompt_tokens: a request keeps its prompt's last k tokens (-1: as many as leave room for one
    output token), and generates what that shorter prompt would; 0 is refused by name."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, kv_cache_gb=0.02)
    prompt = list(range(5, 105))  # 100 tokens: more than max_model_len
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=20),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == llm.generate([prompt[-20:]], params, use_tqdm=False)[0].outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(max_tokens=6, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt[-63:] and len(whole.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=0 is invalid"):
        SamplingParams(truncate_prompt_tokens=0)


def test_stop_strings_are_looked_for_after_min_tokens_outputs(tiny_models):
    """As vLLM: a stop string found in the text of the first min_tokens outputs does not end the output."""
    llm = _llm(tiny_models["llama"])
    prompt = _prompts(1)[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = base.text[:2]
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == "" and len(early.token_ids) < 6
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6 and out.token_ids == base.token_ids[:len(out.token_ids)]
    assert base.text.startswith(out.text) and out.text.startswith(stop)  # the early one stays in the text
    assert out.finish_reason == "length" or out.stop_reason == stop  # or it was found again past the sixth token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_the_stop_tokens(tiny_models, temperature):
    """Before min_tokens outputs the end-of-sequence and stop tokens are never sampled (vLLM's and HF's meaning),
    even where they are all but certain: a bias of +30 makes the first output an EOS without min_tokens; with
    min_tokens 5 the EOS comes sixth and ends the output, and likewise a stop token. The same tokens with n-gram
    drafts (which propose the EOS the prompt repeats)."""
    eos = 258
    prompt = [7, 8, eos, 9] * 4
    plain = _llm(tiny_models["llama"])
    spec = _llm(tiny_models["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                          "prompt_lookup_min": 1, "verification": "shared_noise"})
    assert plain.generate([prompt], SamplingParams(temperature=temperature, seed=1, max_tokens=20,
                                                   logit_bias={eos: 30.0}), use_tqdm=False)[0].outputs[0].token_ids == [eos]
    for stop in ({"logit_bias": {eos: 30.0}}, {"logit_bias": {9: 30.0}, "stop_token_ids": [9], "ignore_eos": True}):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=20, min_tokens=5, **stop)
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ended_by = stop.get("stop_token_ids", [eos])[0]
        assert len(want.token_ids) == 6 and want.token_ids[-1] == ended_by and ended_by not in want.token_ids[:5]
        assert want.finish_reason == "stop"
        assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_ones_sampled(tiny_models, temperature):
    """vLLM's allowed_token_ids: every output token is one of them, greedy and seeded, the same tokens with n-gram
    drafts (which propose others from the prompt); outside the vocabulary, or with structured output, refused."""
    allowed = [40, 41, 42, 258]
    prompt = [40, 41, 7, 8, 40, 41, 7, 8]
    plain = _llm(tiny_models["llama"])
    spec = _llm(tiny_models["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                          "prompt_lookup_min": 1, "verification": "shared_noise"})
    params = SamplingParams(temperature=temperature, seed=2, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(want) == 24 and set(want) <= set(allowed)
    assert temperature == 0 or len(set(want)) > 1  # sampled: spread over them
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids \[320\] outside the vocabulary"):
        plain.generate([prompt], SamplingParams(allowed_token_ids=[5, 320]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[5\] is invalid: must be None with structured_output"):
        SamplingParams(allowed_token_ids=[5], structured_output={"choice": ["a"]})
    assert not plain.engine.has_unfinished_requests()


def test_expected_drafts_equal_what_the_next_step_verifies():
    """The plan's peek (``expected_drafts``) is what the next step allocates when this step's verification
    teaches nothing: 16 requests at batch 16 beside a prompt that finishes next step, with budgets that
    verify several drafts, one, none (low estimate), none (a low estimate after a miss), a request out of max_tokens room and one
    that opted out of speculation; the drafter's step cost is paid. The peek changes no budget."""
    import copy

    from eyas.config import SchedulerConfig
    from eyas.core.request import Request
    from eyas.core.step import RunnerOutput
    from eyas.engine.draft_planner import DraftRecord
    from eyas.engine.scheduler import Scheduler
    from eyas.kv.manager import KVCacheGroupSpec, KVCacheManager
    from eyas.spec_decode.adaptive import DraftBudget, DraftCost, Evidence, RowCost
    from eyas.spec_decode.config import SpeculativeConfig

    k = 4
    kv = KVCacheManager([KVCacheGroupSpec("target", ("layers",), 1)], 512, 16, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024), kv,
                          SpeculativeConfig(method="ngram", num_speculative_tokens=k), draft_row_cost=RowCost.linear(0.07),
                          draft_step_cost=DraftCost(0.35))
    evidence = [(30.0, 0.5), (6.0, 1.0), (2.0, 2.0), (1.0, 4.0)]  # accepted, rejections: 0.96 .. 0.29
    for i in range(16):
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2 if i == 4 else 64, speculate=i != 5)
        scheduler.add(Request(f"r{i}", [7] * 10, 10, params, seed=i, eos_token_ids=frozenset(), max_total_tokens=1024))
        accepted, rejections = evidence[i % 4]
        scheduler.drafts.records[f"r{i}"] = DraftRecord(budget=DraftBudget(
            k, k, missed=i == 6, after_hit=Evidence(accepted, rejections), after_miss=Evidence(0.0, 6.0)))
    scheduler.add(Request("long", [7] * 150, 150, SamplingParams(temperature=0), seed=0, eos_token_ids=frozenset(),
                          max_total_tokens=1024))
    budgets = copy.deepcopy({i: r.budget for i, r in scheduler.drafts.records.items()})
    plan = scheduler.schedule()  # 16 prompts of 10 tokens sample; 96 tokens of the long prompt do not
    assert {i: scheduler.drafts.records[i].budget for i in budgets} == budgets
    expected = plan.expected_drafts
    assert set(expected) == {f"r{i}" for i in range(16)}
    sampled = {e.request.request_id: [8] for e in plan.scheduled if e.will_sample}
    scheduler.commit(plan, RunnerOutput(sampled, dict.fromkeys(sampled, 0), {}, {i: [9] * k for i in sampled},
                                        {i: [False] * k for i in sampled}))
    verified = {e.request.request_id: len(e.draft_token_ids) for e in scheduler.schedule().scheduled
                if e.request.request_id in expected}
    assert verified == expected
    assert expected["r0"] > 1 and expected["r3"] == 0  # a good estimate drafts, a poor one does not
    assert expected["r4"] == 0 and expected["r5"] == 0 and expected["r6"] == 0  # no room, opted out, after a miss


@pytest.mark.skipif(not kernel_available(), reason="no C compiler: neither eyas's products nor its attention kernel")
def test_logprobs_are_the_same_bits_however_the_prompt_was_chunked_or_cached(tiny_models):
    """On a CPU with eyas's kernels doing every product (here int8 weights; PyTorch's float32 matmuls block by the
    row count) every query, prefill chunks included, goes through the paged attention kernel, whose rows do not
    depend on the query's length or on the rows around it: a request's logprobs are the same bits with its prompt
    prefilled whole, in chunks of 16 tokens, or mostly read from the prefix cache. (SDPA's blocking followed the
    query and context lengths: prefill through it moved logprobs by about 1e-6 between such runs.)"""
    path = tiny_models["llama"]
    prompts = [p * 2 for p in _prompts(4)]  # 10-180 tokens: long queries
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)

    def logprobs(llm):
        return [o.outputs[0].logprobs for o in llm.generate(prompts, params, use_tqdm=False)]

    whole = logprobs(_llm(path, enable_prefix_caching=False, quantization="int8"))
    assert logprobs(_llm(path, enable_prefix_caching=False, max_num_batched_tokens=16, quantization="int8")) == whole
    cached = _llm(path, quantization="int8")
    cached.generate([p[:len(p) - 7] for p in prompts], params, use_tqdm=False)  # fills the prefix cache
    outs = cached.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs if len(o.prompt_token_ids) >= 40)
    assert [o.outputs[0].logprobs for o in outs] == whole


def test_a_request_is_compared_by_identity():
    """Two requests with equal fields are two requests: the scheduler's membership checks compare identities
    (field-by-field equality made a step's walk over the running requests quadratic in the batch: 69.8 -> 24.8
    ms a step at batch 512 on a tiny model, 2 cores)."""
    from eyas.core.request import Request

    a, b = (Request("r", [1, 2], 2, SamplingParams(), seed=0, eos_token_ids=frozenset(), max_total_tokens=16,
                    arrival_time=0.0) for _ in range(2))
    assert a != b and a == a and len({a, b}) == 2


def test_text_decoded_at_the_end_equals_the_streamed_text(tiny_models):
    """``generate`` requests do not stream: their text is decoded once, at the end; ``stream`` decodes every step.
    Sampled bytes of a random byte-level model split UTF-8 characters across tokens, so the two must agree on
    held-back and replaced characters too; an aborted non-streaming request still has the text of its tokens,
    and ``step`` returns no output of a non-streaming request before it ends."""
    llm = _llm(tiny_models["llama"])
    params = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=s, skip_special_tokens=skip)
              for s in range(6) for skip in (True, False)]
    prompt = _prompts(1)[0]
    ended = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out, p in zip(ended, params):
        streamed = list(llm.stream(prompt, p))[-1].outputs[0]
        assert (out.outputs[0].token_ids, out.outputs[0].text) == (streamed.token_ids, streamed.text)
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids,
                                                                 skip_special_tokens=p.skip_special_tokens)
    engine = llm.engine
    engine.add_request("quiet", prompt, params[0], stream=False)
    engine.add_request("loud", prompt, params[0])
    for _ in range(5):
        assert [o.request_id for o in engine.step()] == ["loud"]
    aborted = engine.abort_request("quiet").outputs[0]
    engine.abort_request("loud")
    assert len(aborted.token_ids) == 5 and aborted.text == llm.get_tokenizer().decode(aborted.token_ids)


def test_a_drafter_that_catches_up_drafts_after_a_chunked_prompt_only_where_the_catch_up_pays():
    """A drafter that leaves out what it is not told to draft for (``DraftCost.catches_up``) runs its prefill, the
    step a request first drafts, over the prompt's earlier chunks (the request's ``behind``) and the last one. The
    scheduler charges its products over them once, spread over the tokens the request may still make: a
    1,000-token prompt in chunks of 256 costs the drafter's products over 999 rows past the usual one (about 14.1
    one-row forwards at the Xeon's drafter curve), which 8 new tokens do not repay and 400 do. A request told to
    draft is caught up; one told 0 falls further behind."""
    from eyas.config import SchedulerConfig
    from eyas.core.request import Request
    from eyas.core.step import RunnerOutput
    from eyas.engine.scheduler import Scheduler
    from eyas.kv.manager import KVCacheGroupSpec, KVCacheManager
    from eyas.spec_decode.adaptive import DraftCost, RowCost
    from eyas.spec_decode.config import SpeculativeConfig

    products = RowCost(((1, 0.052), (2, 0.065), (4, 0.085), (8, 0.149), (16, 0.254), (32, 0.48)))
    rows = RowCost(((1, 1.0), (2, 1.07), (4, 1.22), (8, 1.64), (16, 2.89)))
    told = {}
    for max_tokens in (8, 400):
        for catches_up in (False, True):
            kv = KVCacheManager([KVCacheGroupSpec("target", ("layers",), 1)], 256, 16, enable_prefix_caching=False)
            scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048), kv,
                                  SpeculativeConfig(method="ngram", num_speculative_tokens=4), draft_row_cost=rows,
                                  draft_step_cost=DraftCost(0.15, products, catches_up=catches_up))
            scheduler.add(Request("r", [7] * 1000, 1000, SamplingParams(temperature=0, ignore_eos=True,
                                                                       max_tokens=max_tokens),
                                  seed=0, eos_token_ids=frozenset(), max_total_tokens=2048))
            behind = []
            while True:
                plan = scheduler.schedule()
                record = scheduler.drafts.records.get("r")
                behind.append(record.behind if record else 0)
                if plan.scheduled[0].will_sample:
                    break
                scheduler.commit(plan, RunnerOutput({}, {}, {}, {}, {}))
            told[max_tokens, catches_up] = plan.expected_drafts["r"]
            # the non-sampling chunks, then 0 once told to draft or all 1,000 once told 0; nothing counted for a
            # drafter that does not catch up
            want = [256, 512, 768, 0 if told[max_tokens, catches_up] else 1000] if catches_up else [0, 0, 0, 0]
            assert behind == want
    assert told[8, False] > 0 and told[8, True] == 0  # 14.1 / 7 forwards a step: not repaid
    assert told[400, False] == told[400, True] > 0  # 14.1 / 399: repaid


def test_a_catch_up_is_spread_over_the_tokens_recent_replies_made_not_over_max_tokens():
    """A drafter's catch-up over a long prompt is paid once and spread over the tokens the request may still make.
    ``max_tokens`` only bounds that: where recent replies ended after a few tokens (tool calls under a generous
    limit), the same prompt is not worth catching up for. A reply its own max_tokens cut (a warm-up of a few tokens)
    says only that it would have run on. Measured before this (``bench_tools.py``, tool_choice "auto", B = 1, the
    shipped EAGLE-3 drafter): every reply's first step ran the drafter's prefill over its 250-500 prompt rows (15-30
    ms each) for replies of about 56 tokens, priced as if they made 96: 0.95x no speculation."""
    from eyas.config import SchedulerConfig
    from eyas.core.request import Request, RequestStatus
    from eyas.engine.draft_planner import RECENT_REPLIES, ReplyLengths
    from eyas.engine.scheduler import Scheduler
    from eyas.kv.manager import KVCacheGroupSpec, KVCacheManager
    from eyas.spec_decode.adaptive import DraftCost, RowCost
    from eyas.spec_decode.config import SpeculativeConfig

    replies = ReplyLengths()
    assert replies.left(50, 300) == 300  # nothing finished yet: its room
    for n in (40, 60, 200):
        replies.add(n)
    assert replies.left(50, 300) == 80 and replies.left(50, 30) == 20  # (10 + 150) / 2; (10 + 30) / 2
    assert replies.left(250, 300) == 300  # longer than every recent reply
    replies.add(None)  # a reply its max_tokens cut: it would have run on
    assert replies.left(50, 300) == 153 and replies.left(250, 300) == 300  # (10 + 150 + 300) / 3

    products = RowCost(((1, 0.052), (2, 0.065), (4, 0.085), (8, 0.149), (16, 0.254), (32, 0.48)))
    rows = RowCost(((1, 1.0), (2, 1.07), (4, 1.22), (8, 1.64), (16, 2.89)))
    kv = KVCacheManager([KVCacheGroupSpec("target", ("layers",), 1)], 512, 16, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_model_len=2048), kv,
                          SpeculativeConfig(method="ngram", num_speculative_tokens=4), draft_row_cost=rows,
                          draft_step_cost=DraftCost(0.15, products, catches_up=True))

    def told(name: str, max_tokens: int = 400, end: RequestStatus = RequestStatus.FINISHED_ABORTED) -> int:
        """What the step ending a 1,000-token prompt tells the drafter (room for max_tokens - 1 drafts); the request
        then ends with ``end`` after 8 tokens (an abort teaches the planner nothing)."""
        scheduler.add(Request(name, [7] * 1000, 1000, SamplingParams(temperature=0, max_tokens=max_tokens),
                              seed=0, eos_token_ids=frozenset(), max_total_tokens=2048))
        plan = scheduler.schedule()
        assert plan.scheduled[0].will_sample
        scheduler.requests[name].token_ids.extend([7] * 8)  # its reply, as commits would have made it
        scheduler.finish(name, end)
        return plan.expected_drafts[name]

    assert told("first") > 0  # 14.1 forwards over 399 tokens: repaid
    for n in range(8):  # warm-ups that max_tokens cut: they say nothing of where replies end
        told(f"warm{n}", max_tokens=8, end=RequestStatus.FINISHED_LENGTH)
    assert told("second") > 0
    for n in range(RECENT_REPLIES):  # replies that stopped after 8 tokens, as many as are kept: the warm-ups go
        told(f"short{n}", end=RequestStatus.FINISHED_STOPPED)
    assert told("third") == 0  # 14.1 forwards over 8 tokens: not repaid
