"""The real default model (SmolLM2-135M-Instruct from the shipped GGUF) against HF transformers."""

import pytest
import torch

from eyas import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about falcons.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in one paragraph, please, with the key events in order.",
    "hi",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def real():
    # float32 products, as HF multiplies (the default on an AVX512-BF16 CPU rounds them to bfloat16)
    llm = LLM(None, dtype="float32", max_model_len=1024, kv_cache_gb=0.25, matmul_precision="highest")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    return llm, prompts


@pytest.fixture(scope="module")
def hf_reference(real):
    import transformers

    llm, prompts = real
    model = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.config.model.path, dtype=torch.float32)
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_batch1_matches_hf(real, hf_reference):
    llm, prompts = real
    for p, ref in zip(prompts, hf_reference):
        assert llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_greedy_batched_mixed_lengths_matches_hf(real, hf_reference):
    llm, prompts = real
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference


def test_real_model_preemption_and_chunking_keep_outputs(real, hf_reference):
    _, prompts = real
    llm = LLM(None, dtype="float32", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=32,
              matmul_precision="highest")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference


def test_chat_and_text(real):
    llm, _ = real
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text


def test_the_readme_first_command_answers_without_looping(capsys):
    """`eyas generate "Write a haiku about falcons."` with the built-in model's default sampling: a short
    answer that ends on its own, no 4-word sequence three times (greedy decoding loops on this prompt)."""
    from collections import Counter

    from eyas.cli import main

    assert main(["generate", "Write a haiku about falcons.", "--max-model-len", "1024", "--kv-cache-gb", "0.25"]) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    assert 5 <= len(words) < 150 and "finish=stop" in captured.err
    assert Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3)).most_common(1)[0][1] < 3


def test_loading_the_default_model_leaves_torchs_compiler_stack_unimported():
    """Start-up: a module built on the meta device and then given storage touched torch's reference kernels
    (a meta tensor's normal_, its empty_like), whose first calls import torch._dynamo and sympy: about 1 s of a
    2.6 s start. A fresh interpreter loads the default model and the shipped EAGLE-3 drafter without them."""
    import subprocess
    import sys

    code = ("import sys\nfrom eyas import LLM\nLLM(None, kv_cache_gb=0.05, max_model_len=256, "
            "speculative_config={'method': 'eagle3'})\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
