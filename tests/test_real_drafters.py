"""EAGLE, EAGLE-3 (SafeAILab and speculators folders) and MTP drafters on the real default model:
greedy speculative output equals plain output, batch 1 and 8, with preemption and chunked prefill."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from engine_helpers import run_counting_preemptions

from eyas import LLM, SamplingParams
from eyas.model.resolve import resolve_model

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

QUESTIONS = ["hi", "What is the capital of France?", "Write a haiku about falcons.",
             "Explain what a hash table is in two sentences.", "List three prime numbers greater than 50.",
             "Why is the sky blue?", "Translate 'good morning' into Spanish.", "Name a famous painter."]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from bench_drafters import make_drafters

    from eyas.model.drafters import save_drafter

    root = tmp_path_factory.mktemp("real_drafters")
    target = resolve_model(None)
    methods = make_drafters(target, root)
    eagle3 = LLM(str(target), dtype="float32", max_model_len=512, kv_cache_gb=0.1,
                 speculative_config={**methods["eagle3"], "num_speculative_tokens": 2}).engine.runner.proposer.drafter
    save_drafter(eagle3, root / "speculators", "speculators", verifier=str(target), num_speculative_tokens=3)
    methods["eagle3_speculators"] = {"method": "eagle3", "model": str(root / "speculators")}
    plain = LLM(str(target), dtype="float32", max_model_len=512, kv_cache_gb=0.1)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    return target, methods, prompts, want


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3_speculators", "mtp"])
def test_real_model_greedy_speculation_equals_plain(setup, method):
    target, methods, prompts, want = setup
    spec = dict(methods[method])
    model = spec.pop("target", str(target))
    if method != "eagle3_speculators":
        spec["num_speculative_tokens"] = 3
    alone = LLM(model, dtype="float32", max_model_len=512, kv_cache_gb=0.1, speculative_config=spec)
    out = alone.generate(prompts[:1], PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0] and out.spec_metrics["num_drafted"] > 0
    tight = LLM(model, dtype="float32", max_model_len=128, num_kv_blocks=20, block_size=16,
                max_num_batched_tokens=32, speculative_config=spec)
    outs, preemptions = run_counting_preemptions(tight, prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == want and preemptions > 0
