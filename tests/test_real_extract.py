"""Hidden-state dumps of the real default model equal HF transformers' output_hidden_states."""

import pytest
import torch
from engine_helpers import run_counting_preemptions
from safetensors.torch import load_file

from eyas import LLM, SamplingParams

pytestmark = pytest.mark.slow

N = 30
IDS = [2, N // 2, N - 3, N]  # the EAGLE-3 default plus the final pre-norm stream (as speculators appends it)
QUESTIONS = [
    "hi",
    "Explain what a hash table is in two sentences.",
    "Write a short story about a falcon that learns to read, in about five sentences, with a twist at the end.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue? Answer like a physics teacher talking to ten-year-olds, step by step.",
    "Translate 'good morning' into Spanish and German.",
    "What is the capital of France?",
]


def test_real_model_dumps_equal_hf_with_chunking_and_preemption(tmp_path):
    import transformers

    llm = LLM(None, dtype="float32", max_model_len=256, num_kv_blocks=17, block_size=16, max_num_batched_tokens=32,
              matmul_precision="highest",  # float32 products, as HF multiplies
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "aux_layer_ids": IDS, "output_dir": str(tmp_path), "include_output_tokens": True})
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs, preemptions = run_counting_preemptions(llm, prompts, params)
    assert preemptions > 0  # the small pool forced recomputation

    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.config.model.path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        dump = load_file(out.hidden_states_path)
        ids = prompt + out.outputs[0].token_ids[:-1]
        assert dump["token_ids"].tolist() == ids
        with torch.inference_mode():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            got = dump["hidden_states"].clone()
            got[:, -1] = hf.model.norm(got[:, -1])  # HF's last entry is after the final norm
        ref = torch.stack([states[k][0] for k in IDS], dim=1)  # [num_tokens, 4, 576]
        scale = ref.abs().amax(dim=(0, 2), keepdim=True)  # per-layer magnitude (SmolLM2 has large outliers)
        torch.testing.assert_close(got / scale, ref / scale, rtol=0, atol=1e-4)
