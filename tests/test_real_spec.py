"""Speculative decoding on the real default model: token-identical to plain greedy decoding."""

import json

import pytest
from safetensors.torch import load_file, save_file
from test_quant_kernels import NEEDS_MEDIUM

from eyas import LLM, SamplingParams
from eyas.model import quantized as Q

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def _weights(mode: str) -> dict:
    """LLM keyword arguments of a mode: a quantization, with "@medium" for bfloat16 products (float32 without)."""
    quantization, _, precision = mode.partition("@")
    return dict(quantization=quantization, matmul_precision=precision or "highest")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # gguf weights with float32 products, as "gguf" below runs them (the default may take bfloat16 products)
    plain = LLM(None, dtype="float32", max_model_len=512, kv_cache_gb=0.1, **_weights("gguf"))
    tok = plain.get_tokenizer()
    from eyas.data.prompts import copy_prompts

    convs = copy_prompts(3) + [[{"role": "user", "content": q}] for q in
                               ["What is the capital of France?", "Write a haiku about rain.",
                                "Name three colours.", "Count from 1 to 10.", "hi"]]
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)[-300:] for c in convs]
    reference = {"gguf": [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]}
    for mode in ("int8", "bf16") + (("gguf@medium",) if Q.kernel_available("medium") else ()):
        llm = LLM(None, dtype="float32", max_model_len=512, kv_cache_gb=0.1, **_weights(mode))
        reference[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    # a smaller sibling with the same vocabulary: the default model's first 6 layers, saved as its own folder
    folder = plain.engine.config.model.path
    small = tmp_path_factory.mktemp("sibling")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (small / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in load_file(folder / "model.safetensors").items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < 6}
    save_file(weights, small / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (small / name).write_bytes((folder / name).read_bytes())
    return prompts, reference, str(small)


@pytest.mark.parametrize("method,quantization", [("ngram", "gguf"), ("self_draft", "gguf"), ("draft_model", "gguf"),
                                                 ("ngram", "int8"), ("self_draft", "int8"), ("ngram", "bf16"),
                                                 pytest.param("ngram", "gguf@medium", marks=NEEDS_MEDIUM),
                                                 pytest.param("self_draft", "gguf@medium", marks=NEEDS_MEDIUM)])
def test_real_model_speculative_greedy_is_identical(setup, method, quantization):
    """In the default model's own GGUF formats (also with bfloat16 products), in int8 and in bf16, batch 8 and 1,
    prefix-cached, preempted."""
    prompts, references, sibling = setup
    reference = references[quantization]
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
              "self_draft": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 8},
              "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": sibling}}[method]
    config["draft_row_cost"] = 0.0  # every request of the batch of 8 verifies its drafts (not the CPU cost model)
    llm = LLM(None, dtype="float32", max_model_len=512, kv_cache_gb=0.1, speculative_config=config,
              **_weights(quantization))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == reference  # batch 8
    assert llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == reference[0]  # batch 1
    # again, now hitting the prefix cache for every prompt
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.stats()["num_accepted"] > 0
    tight = LLM(None, dtype="float32", max_model_len=384, num_kv_blocks=40, max_num_batched_tokens=64,
                speculative_config=config, **_weights(quantization))  # forced preemption
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, PARAMS, use_tqdm=False)] == reference
