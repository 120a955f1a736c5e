"""Matmul precision "low" (int8 activations, integer dot products) on the real default model: logits within a stated
bound of HF transformers in float32 on the same (dequantized GGUF) weights, and greedy speculative decoding with
n-gram, suffix and the shipped EAGLE-3 drafter token-identical to plain decoding in the same mode."""

import pytest
import torch
from test_model_vs_hf import _eyas_logits_by_chunks

from eyas import LLM, SamplingParams
from eyas.data.prompts import copy_prompts
from eyas.model import quantized as Q
from eyas.model.resolve import resolve_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Q.kernel_available("low"), reason="no C compiler: the q8 kernel cannot be built")]
LOW = dict(quantization="gguf", matmul_precision="low", max_model_len=512, kv_cache_gb=0.05)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    """The plain engine in "low", its prompts (2 copy-heavy, 2 chat) and their greedy outputs."""
    llm = LLM(None, **LOW)
    tok = llm.get_tokenizer()
    convs = copy_prompts(2) + [[{"role": "user", "content": q}] for q in
                               ["What is the capital of France?", "Count from 1 to 10."]]
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)[-250:] for c in convs]
    return llm, prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_logits_stay_within_the_stated_bound_of_hf_float32(plain):
    """Bound: mean |error| <= 0.35 and max <= 6 over 200 positions, the same top token at >= 95% of them. Measured
    (Intel Xeon, AVX512-VNNI, 2026-11-28), with every product on int8 activations: mean 0.22, max 3.7, 97.5%; with
    the q/k/v products on float32, bench_logits.py's 256 positions: mean 0.14, max 1.6, 98.4% (llama.cpp 0.18, 2.2,
    98.0%; HF's own model in bfloat16 0.13, 1.2, 97.3%); with them split in two int8 rows (as "low" runs them now;
    AMD Zen 4, 2026-11-29): mean 0.15, max 1.4, 98.0%. The error is the int8 rounding of each
    block of 32 activations (half a step of max|x| / 127), which an outlier channel makes coarse for its block."""
    import transformers

    _, prompts, _ = plain
    tokens = [t for p in prompts for t in p][:200]
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = _eyas_logits_by_chunks(LLM(None, **LOW, enable_prefix_caching=False), tokens)  # every position computed
    err = (got - ref).abs()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert err.mean() <= 0.35 and err.max() <= 6.0 and agree >= 0.95, (err.mean(), err.max(), agree)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "suffix"},
                                  {"method": "eagle3"}], ids=["ngram", "suffix", "eagle3"])
def test_greedy_speculation_is_token_identical_in_low_precision(plain, spec):
    """Batch 4 and batch 1, every draft verified (a row's result does not depend on the rows beside it)."""
    _, prompts, want = plain
    llm = LLM(None, **LOW, speculative_config={**spec, "draft_row_cost": 0.0})
    assert llm.engine.config.matmul_precision == "low"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    assert llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want[0]
    assert llm.stats()["num_accepted"] > 0
