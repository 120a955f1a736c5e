"""Presence, frequency and repetition penalties and logit_bias: the documented formula, HF's repetition
penalty, an independent step-by-step reference, the sampled distribution, losslessness under every
proposer (greedy and shared-noise seeded), and bad values refused with the engine still serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from eyas import LLM, SamplingParams
from eyas.sampling.allowed import restrict
from eyas.sampling.penalties import penalize

ALPHA = 1e-3
PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={17: 3.0, 4: -5.0})


def test_penalize_follows_the_documented_example():
    """The module docstring's example, computed by hand: prompt [5], output [7, 7], drafts [9]."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, -2.0, 6.0, 7.0, 8.0, -1.0, 10.0]]).repeat(2, 1)  # rows 0 and 1
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    out = penalize(logits, [(params, [5, 7, 7], 1, [9])])
    want = logits.clone()
    want[:, 5] = 6.0 / 2
    want[:, 7] = 8.0 / 2 - 0.5 * 2 - 1
    want[1, 9] = 10.0 / 2 - 0.5 - 1
    torch.testing.assert_close(out, want)
    assert torch.equal(logits[0], torch.tensor([1.0, 2.0, 3.0, 4.0, -2.0, 6.0, 7.0, 8.0, -1.0, 10.0]))  # input kept
    negative = penalize(-logits[:1], [(SamplingParams(repetition_penalty=2.0), [5], 1, [])])
    assert negative[0, 5] == -12.0 and negative[0, 6] == -7.0  # negative logits are multiplied
    biased = penalize(logits[:1], [(SamplingParams(logit_bias={"3": -100}), [], 0, [])])  # JSON keys
    assert biased[0, 3] == 4.0 - 100
    plain = SamplingParams()
    assert penalize(logits, [(plain, [5, 7], 1, [9])]) is logits  # nothing to do: no copy



def test_restrict_follows_the_documented_example():
    """eyas.sampling.allowed's example: min_tokens 3, eos {2}, stop_token_ids [9], 1 output made, 3 drafts; then
    with allowed_token_ids [2, 5, 9] too."""
    logits = torch.randn(4 + 2, 12)
    params = SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=[9])
    out = restrict(logits, [(params, frozenset({2}), 1, 3, False), (params, frozenset({2}), 0, 1, True)])
    want = logits.clone()
    want[[0, 0, 1, 1], [2, 9, 2, 9]] = float("-inf")
    assert torch.equal(out, want)  # the second request has a grammar: left alone
    allowed = SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=[9], allowed_token_ids=[2, 5, 9])
    out = restrict(logits[:4], [(allowed, frozenset({2}), 1, 3, False)])
    assert [torch.isfinite(row).nonzero()[:, 0].tolist() for row in out] == [[5], [5], [2, 5, 9], [2, 5, 9]]
    assert torch.equal(out[3, [2, 5, 9]], logits[3, [2, 5, 9]])
    only_stops = SamplingParams(min_tokens=3, max_tokens=10, allowed_token_ids=[2])  # a row is never emptied
    assert torch.isfinite(restrict(logits[:1], [(only_stops, frozenset({2}), 0, 0, False)])).sum() == 1
    ignoring = SamplingParams(min_tokens=3, max_tokens=10, ignore_eos=True)
    assert torch.isinf(restrict(logits[:1], [(ignoring, frozenset({2}), 0, 0, False)])).sum() == 0
    assert restrict(logits, [(params, frozenset({2}), 3, 5, False)]) is logits  # past min_tokens: no copy
    past = restrict(logits[:1], [(params, frozenset({2, 40}), 0, 0, False)])  # an EOS id past the vocabulary
    assert torch.isinf(past).sum() == 2


def _dense_reference(x, params, prompt, output, drafts):
    """The formula over the whole vocabulary, row by row: counts of the output and of drafts[:j]."""
    x = x.clone()
    for j in range(len(x)):
        counts = torch.zeros(x.shape[1], dtype=torch.int64)
        for t in output + drafts[:j]:
            counts[t] += 1
        for t, b in (params.logit_bias or {}).items():
            x[j, int(t)] += b
        hit = counts > 0
        hit[prompt] = True
        if params.repetition_penalty != 1.0:
            x[j] = torch.where(hit, torch.where(x[j] > 0, x[j] / params.repetition_penalty,
                                                x[j] * params.repetition_penalty), x[j])
        x[j] = x[j] - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return x


@pytest.mark.parametrize("seed", range(4))
def test_penalize_equals_the_formula_over_the_whole_vocabulary_bit_for_bit(seed):
    """Random histories with repeats, drafts that repeat the output and each other, two requests in one batch (one
    without penalties): the rows equal the formula applied to every token of the vocabulary, exactly."""
    g = torch.Generator().manual_seed(seed)
    vocab = 300
    rows, want, x = [], [], []
    for r, params in enumerate((SamplingParams(**PENALTIES), SamplingParams(),
                                SamplingParams(repetition_penalty=0.8, presence_penalty=-0.3))):
        prompt = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(20, 60, (int(torch.randint(0, 50, (1,), generator=g)),), generator=g).tolist()
        drafts = torch.randint(50, 70, (r + 2,), generator=g).tolist()
        logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 4
        rows.append((params, prompt + output, len(prompt), drafts))
        want.append(_dense_reference(logits, params, prompt, output, drafts) if params.has_penalties else logits)
        x.append(logits)
    assert torch.equal(penalize(torch.cat(x), rows), torch.cat(want))

def test_greedy_repetition_penalty_equals_hf(tiny_models):
    model = tiny_models["llama"]
    prompts = [[3, 9, 9, 4, 100, 3], [250, 1, 1, 1, 7]]
    llm = LLM(str(model), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    got = llm.generate(prompts, SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, got):
        ids = hf.generate(torch.tensor([prompt]), do_sample=False, repetition_penalty=1.8, max_new_tokens=24,
                          min_new_tokens=24, pad_token_id=0)
        assert out.outputs[0].token_ids == ids[0, len(prompt):].tolist()


def _reference_greedy(hf, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Step by step with HF's logits and the penalties written out from their definitions."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        output = ids[len(prompt):]
        for t, b in (params.logit_bias or {}).items():
            logits[t] += b
        for t in set(prompt) | set(output):
            r = params.repetition_penalty
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(output):
            logits[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_greedy_with_every_penalty_equals_a_step_by_step_reference(tiny_models):
    model = tiny_models["llama"]
    prompts = [[3, 9, 9, 4, 100, 3], [250, 1, 1, 1, 7], [17, 4]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **PENALTIES)
    llm = LLM(str(model), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert got == [_reference_greedy(hf, p, params, 20) for p in prompts]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                                  ignore_eos=True), use_tqdm=False)]
    assert got != plain  # the penalties changed something


def test_sampled_first_token_follows_the_penalized_distribution(tiny_models):
    model = tiny_models["llama"]
    prompt = [5, 6, 7, 5, 6, 7, 8]
    params = [SamplingParams(temperature=1.3, repetition_penalty=2.5, logit_bias={11: 2.0}, seed=s, max_tokens=1)
              for s in range(4000)]
    llm = LLM(str(model), dtype="float32", max_model_len=64, kv_cache_gb=0.05, max_num_seqs=256)
    tokens = torch.tensor([o.outputs[0].token_ids[0] for o in llm.generate([prompt] * 4000, params, use_tqdm=False)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    logits[11] += 2.0
    for t in set(prompt):
        logits[t] = logits[t] / 2.5 if logits[t] > 0 else logits[t] * 2.5
    probs = torch.softmax(logits / 1.3, -1).numpy()
    assert _pooled(tokens, probs) > ALPHA


def _pooled(tokens: torch.Tensor, probs: np.ndarray) -> float:
    """Chi-square with the rare tokens pooled into one bin (expected counts below 5 distort the test)."""
    expected = probs * len(tokens)
    common = expected >= 5
    counts = np.bincount(tokens.numpy(), minlength=len(probs))
    obs = np.append(counts[common], counts[~common].sum())
    exp = np.append(expected[common], expected[~common].sum())
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("kwargs, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
])
def test_bad_penalties_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_leave_the_engine_serving(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3)
    before = llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[400\] outside the vocabulary \[0, 320\)"):
        llm.generate([[1, 2, 3], [4]], [good, SamplingParams(logit_bias={400: 1.0})], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"stop_token_ids: token ids \[320\] outside the vocabulary \[0, 320\)"):
        llm.generate([[4]], SamplingParams(stop_token_ids=[320], min_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].outputs[0].token_ids == before
