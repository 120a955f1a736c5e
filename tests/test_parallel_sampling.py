"""``SamplingParams.n``: n samples of one prompt are n seeded requests (seed + i), share the prompt's
cached blocks, come back as one output with outputs[0..n-1], abort together, and bad n is refused."""

from __future__ import annotations

import pytest

from eyas import LLM, SamplingParams

PROMPT = list(range(3, 43))  # 40 tokens: two full blocks of 16 to share


def _llm(tiny_models, **kw):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, kv_cache_gb=0.01, **kw)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}])
def test_child_i_samples_what_a_single_request_with_seed_plus_i_samples(tiny_models, spec):
    llm = _llm(tiny_models, speculative_config=spec)
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    (parent,) = llm.generate([PROMPT], SamplingParams(n=3, seed=11, **params), use_tqdm=False)
    assert parent.finished and [c.index for c in parent.outputs] == [0, 1, 2]
    singles = [llm.generate([PROMPT], SamplingParams(seed=11 + i, **params), use_tqdm=False)[0].outputs[0]
               for i in range(3)]
    assert [c.token_ids for c in parent.outputs] == [s.token_ids for s in singles]
    assert [c.text for c in parent.outputs] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in parent.outputs}) > 1  # the seeds differ, so do the samples
    assert parent.metrics.num_output_tokens == 36


def test_the_children_share_the_prompts_blocks(tiny_models):
    llm = _llm(tiny_models)
    engine = llm.engine
    engine.add_request("p", PROMPT, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    children = engine.parents["p"].children
    while engine.has_unfinished_requests():
        engine.step()
    assert children[0].num_cached_tokens == 0
    assert [c.num_cached_tokens for c in children[1:]] == [32, 32, 32]  # both full blocks, from child 0


def test_greedy_children_are_identical_and_stream_as_one_output(tiny_models):
    llm = _llm(tiny_models)
    seen = list(llm.stream(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)))
    assert all(len(o.outputs) == 2 for o in seen) and seen[-1].finished and not any(o.finished for o in seen[:-1])
    first, second = seen[-1].outputs
    alone = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert first.token_ids == second.token_ids == alone[0].outputs[0].token_ids


def test_abort_ends_every_child_and_frees_their_blocks(tiny_models):
    llm = _llm(tiny_models)
    engine = llm.engine
    free = engine.kv.num_free_blocks
    engine.add_request("p", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.add_request("other", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("p")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert "p" not in engine.parents and engine.abort_request("p") is None
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["other"] and len(done["other"].outputs[0].token_ids) == 3
    assert engine.kv.num_free_blocks == free


@pytest.mark.parametrize("n", [0, -1, 2.5])
def test_bad_n_is_refused(n):
    with pytest.raises(ValueError, match=r"SamplingParams.n=.* must be an integer >= 1"):
        SamplingParams(n=n)


def test_a_taken_parent_id_is_refused(tiny_models):
    engine = _llm(tiny_models).engine
    engine.add_request("p", PROMPT, SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="request_id: 'p' is already running"):
        engine.add_request("p", PROMPT, SamplingParams(max_tokens=2))
