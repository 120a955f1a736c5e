"""Structured output under speculation: lossless for every proposer (greedy always, seeded with shared
noise), every output valid, forced drafts always accepted, rejection sampling follows the masked target
distribution, and bad schemas and grammars refused at the edge while the engine keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import K
from scipy import stats

from eyas import LLM, SamplingParams
from eyas.spec_decode import registry
from eyas.spec_decode.proposer import Proposer, ProposerOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "tag", "flags", "at"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green", "blue"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "at": {"type": "object", "required": ["x"], "additionalProperties": False,
                                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}}}}}
REGEX = r"[a-c]{2,5}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma ray"]
SPECS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]
SETTINGS = dict(dtype="float32", max_model_len=256, kv_cache_gb=0.05)


def _valid(text: str, spec: dict) -> bool:
    kind, value = next(iter(spec.items()))
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
        return True
    return re.fullmatch(value, text) is not None if kind == "regex" else text in value


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 40, 17, 70, 3, 33, 50, 9][:n]
    return [torch.randint(0, 256, (m,), generator=g).tolist() for m in lengths]


def _params(temperature: float = 0.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=100 + i, max_tokens=128, structured_output=SPECS[i % 3])
            for i in range(8)]


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("structured") / "draft", "qwen3", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain(tiny_models):
    """Outputs without speculation: greedy, and seeded at temperature 0.8."""
    llm = LLM(str(tiny_models["llama"]), **SETTINGS)
    return {t: llm.generate(_prompts(8), _params(t), use_tqdm=False) for t in (0.0, 0.8)}


def _spec(case: str, drafters, draft_model) -> tuple[str, dict]:
    """(the LLM's model, speculative_config) of a proposer under test."""
    target = str(drafters.target)
    configs = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(draft_model)},
        "self_draft": {"method": "draft_model", "draft_num_layers": 1},
        "eagle": {"method": "eagle", "model": drafters.folders["eagle"]},
        "eagle3": {"method": "eagle3", "model": drafters.folders["eagle3"]},
        "mtp": {"method": "mtp"},
    }
    model = drafters.folders["mtp_1"] if case == "mtp" else target  # MTP layers live in the target's folder
    return model, {"num_speculative_tokens": K, **configs[case]}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", ["ngram", "draft_model", "self_draft", "eagle", "eagle3", "mtp"])
def test_every_proposer_is_lossless_under_json_regex_and_choice(drafters, draft_model, plain, case):
    """Batch 1 with rejection verification (greedy), batch 8 with preemption and chunked prefill under
    shared-noise verification (greedy and seeded): the tokens of plain decoding, every output valid."""
    model, spec = _spec(case, drafters, draft_model)
    prompts, greedy, seeded = _prompts(8), _params(0.0), _params(0.8)
    for outs in plain.values():
        assert all(o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text, SPECS[i % 3])
                   for i, o in enumerate(outs))
    alone = LLM(model, **SETTINGS, speculative_config={**spec, "verification": "rejection"})
    for i in range(3):
        assert _tokens(alone.generate(prompts[i:i + 1], greedy[i], use_tqdm=False)) == _tokens(plain[0.0][i:i + 1])
    assert alone.stats()["num_drafted"] > 0
    tight = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=18, max_num_batched_tokens=32,
                speculative_config={**spec, "verification": "shared_noise"})
    for params, want in ((greedy, plain[0.0]), (seeded, plain[0.8])):
        engine = tight.engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        requests = list(engine.scheduler.requests.values())
        done, steps = {}, 0
        while engine.has_unfinished_requests() and steps < 1000:  # a waiting request that keeps the cached prefix
            done.update({o.request_id: o for o in engine.step() if o.finished})  # it took starved the others here
            steps += 1
        assert not engine.has_unfinished_requests(), "the scheduler stalled"
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(8)] == _tokens(want)
        assert sum(r.num_preemptions for r in requests) > 0
    stats = tight.stats()
    assert stats["num_drafted"] > 0 and stats["num_forced"] == stats["num_forced_accepted"] > 0
    assert not tight.engine.kv.tables  # nothing leaks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_drafts_are_always_accepted_and_counted(tiny_models, temperature):
    """A one-string choice forces every token: the prefill emits 'a', then one step drafts b .. p and EOS, all
    forced and accepted: past the n-gram's k = 4, since forced drafts run up to the lookahead of 16."""
    llm = LLM(str(tiny_models["llama"]), **SETTINGS, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3})  # no n-gram match: forced only
    params = SamplingParams(temperature=temperature, max_tokens=50, structured_output={"choice": ["abcdefghijklmnop"]})
    out = llm.generate([[7, 8, 9]], params, use_tqdm=False)[0]
    assert out.outputs[0].text == "abcdefghijklmnop" and out.outputs[0].finish_reason == "stop"
    m = out.spec_metrics
    assert (m["num_steps"], m["num_drafted"], m["num_accepted"], m["num_forced"], m["num_forced_accepted"]) == \
        (1, 16, 16, 16, 16)
    assert out.outputs[0].from_draft == [False] + [True] * 16  # a..p, EOS

    # a JSON schema on random prompts: forced drafts (keys, punctuation) are a large share, all accepted
    outs = llm.generate(_prompts(8), SamplingParams(temperature=temperature, seed=1, max_tokens=128,
                                                    structured_output={"json": SCHEMA}), use_tqdm=False)
    for o in outs:
        m = o.spec_metrics
        assert m["num_forced"] == m["num_forced_accepted"] >= 20, m
        assert m["mean_acceptance_length"] > 2.0
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_one_per_committed_token_when_a_verification_accepts_the_end(tiny_models, temperature):
    """One step verifies b .. p and EOS (all forced) and samples a token after them: that token is not committed,
    and gets no logprob (it had one: 18 logprobs for 17 tokens)."""
    llm = LLM(str(tiny_models["llama"]), **SETTINGS, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3})
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=50, logprobs=0,
                            structured_output={"choice": ["abcdefghijklmnop"]})
    out = llm.generate([[7, 8, 9]], params, use_tqdm=False)[0]
    assert out.outputs[0].text == "abcdefghijklmnop" and out.spec_metrics["num_steps"] == 1
    assert [next(iter(lp)) for lp in out.outputs[0].logprobs] == out.outputs[0].token_ids  # a..p, EOS


class FixedQProposer(Proposer):
    """Samples K drafts from a fixed q (with its probabilities), some of them forbidden by the test's grammar."""

    method = "fixed_q"
    q: torch.Tensor = torch.zeros(0)

    def __init__(self, spec, config, target):
        self.k = spec.num_speculative_tokens
        self.generator = torch.Generator().manual_seed(1234)

    def propose(self, inp):
        rows = len(inp.token_ids)
        drafts = torch.multinomial(self.q.expand(rows * self.k, -1), 1, generator=self.generator).view(rows, self.k)
        return ProposerOutput(drafts, torch.full((rows,), self.k), self.q.expand(rows, self.k, -1).clone())


def test_rejection_sampling_under_a_grammar_follows_the_masked_target(tiny_models, monkeypatch):
    """Two tokens of ``[a-d]{2}`` sampled at temperature 1; the second is drafted from q = 0.3 'a', 0.3 'b',
    0.4 'x' (x is forbidden: cut before verification, and a kept draft's q is renormalised to 0.5 / 0.5), then
    EOS is forced. The 16 outcomes of 2000 seeds must follow the target's masked, renormalised distribution:
    chi-square test at alpha = 0.001."""
    import transformers

    from eyas.model.tokenizer import Tokenizer

    path = tiny_models["llama"]
    tok = Tokenizer.from_folder(path)
    letters = [tok.encode(c, add_special_tokens=False)[0] for c in "abcd"]
    q = torch.zeros(320)
    q[letters[0]], q[letters[1]], q[tok.encode("x", add_special_tokens=False)[0]] = 0.3, 0.3, 0.4
    monkeypatch.setattr(FixedQProposer, "q", q)
    monkeypatch.setitem(registry.PROPOSERS, "fixed_q", (__name__, "FixedQProposer"))
    prompt, n = [5, 6, 7, 8], 2000
    llm = LLM(str(path), **SETTINGS, max_num_seqs=256, speculative_config={
        "method": "fixed_q", "num_speculative_tokens": 2, "verification": "rejection", "adaptive_draft_length": False})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, structured_output={"regex": "[a-d]{2}"})
              for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    totals = llm.stats()
    assert 300 < totals["num_accepted"] - totals["num_forced_accepted"] < totals["num_drafted"] - totals["num_forced"]
    counts = torch.zeros(4, 4)
    for o in outs:
        a, b = (letters.index(t) for t in o.outputs[0].token_ids[:2])
        counts[a, b] += 1

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    def masked(prefix: list[int]) -> torch.Tensor:  # [4] the target's next-letter distribution
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1]
        return torch.softmax(logits[letters], dim=-1)

    expected = masked([])[:, None] * torch.stack([masked([t]) for t in letters]) * n  # [4, 4]
    assert expected.min() >= 5  # every cell large enough for the chi-square approximation
    chi2, p_value = stats.chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert p_value > 0.001, (chi2, p_value)


@pytest.fixture(scope="module")
def serving(tiny_models):
    return LLM(str(tiny_models["llama"]), **SETTINGS)


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "objekt"}}, r"structured_output\.json: .*objekt"),
    ({"json": "{not json"}, r"structured_output\.json: not a JSON object"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, r"structured_output\.json: .*nowhere"),
    ({"regex": "[a-z"}, r"structured_output\.regex: .*unclosed character class"),
    ({"grammar": "start: missing_rule"}, r"structured_output\.grammar: .*missing_rule"),
    ({"grammar": 'root ::= "a" | [0-9'}, r"structured_output\.grammar: "),
    ({"choice": []}, r"structured_output=.*a non-empty list of non-empty strings"),
    ({"jsn": {}}, r"structured_output=.*exactly one of the keys json, json_object, regex, choice, grammar"),
    ({"json": {}, "regex": "a"}, r"exactly one of the keys"),
])
def test_bad_schemas_and_grammars_are_refused_and_the_engine_keeps_serving(serving, spec, message):
    llm = serving
    with pytest.raises(ValueError, match=f"(?s){message}"):  # llguidance messages span lines
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured_output=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=40, structured_output={"json_object": True}),
                      use_tqdm=False)[0]
    assert isinstance(json.loads(ok.outputs[0].text), dict)


def test_n_samples_and_prefix_caching_each_follow_their_own_grammar_position(tiny_models):
    """n = 4 children share the prompt's cached blocks and each walk the grammar on their own: each equals
    the single request with its seed, with and without speculation."""
    path = str(tiny_models["llama"])
    params = SamplingParams(n=4, temperature=0.9, seed=40, max_tokens=128, structured_output={"json": SCHEMA})
    singles = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=128, structured_output={"json": SCHEMA})
               for i in range(4)]
    want = _tokens(LLM(path, **SETTINGS, enable_prefix_caching=False).generate([[3, 4, 5] * 10] * 4, singles,
                                                                               use_tqdm=False))
    for spec in (None, {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1,
                        "verification": "shared_noise"}):
        out = LLM(path, **SETTINGS, speculative_config=spec).generate([[3, 4, 5] * 10], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == want
        assert out.num_cached_tokens > 0
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_greedy_picks_under_a_mask_equal_the_argmax_of_the_masked_row():
    """The greedy shortcuts (a draft's ``_masked_argmax``, verification's ``GrammarMasks.argmax``) mask only the rows
    whose best token is forbidden; every row must still get the masked row's argmax. Rows of 100 tokens (4 mask
    words, the last partly past the vocabulary) with many ties, masks that allow everything, one token, a random
    share, or only tokens the row puts at -inf; every other row without a grammar for the drafts."""
    import numpy as np

    from eyas.sampling.grammar import allowed_tokens
    from eyas.sampling.grammar_masks import GrammarMasks
    from eyas.sampling.row_ops import argmax
    from eyas.spec_decode.draft_sampling import _mask, _masked_argmax

    generator = torch.Generator().manual_seed(0)
    vocab, words, rows = 100, 4, 64
    logits = torch.randint(0, 6, (rows, vocab), generator=generator).float()  # [R, V] many ties
    bits = torch.rand(rows, words * 32, generator=generator) < torch.rand(rows, 1, generator=generator)
    bits[0] = True
    bits[2], bits[2, 77] = False, True
    logits[4, :50] = -float("inf")  # row 4 allows only tokens it puts at -inf
    bits[4], bits[4, 3] = False, True
    bits[:, vocab:] = False
    packed = np.stack([np.packbits(b.numpy(), bitorder="little").view(np.uint32) for b in bits])  # [R, W]
    bitmasks = {r: packed[r] for r in range(0, rows, 2)}
    best = logits.argmax(-1)
    forbidden = [r for r in bitmasks if not bits[r, best[r]]]
    assert 0 < len(forbidden) < len(bitmasks) and 2 in forbidden and 4 in forbidden  # both paths run
    assert torch.equal(_masked_argmax(logits, bitmasks), argmax(_mask(logits, bitmasks)))
    masks = GrammarMasks(allowed_tokens(torch.from_numpy(packed.view(np.int32)), vocab))
    assert torch.equal(masks.argmax(logits), argmax(masks.apply(logits)))
