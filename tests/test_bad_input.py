"""Every bad input gets a ValueError naming the field, and the engine keeps serving the others."""

import json
import shutil

import pytest

from eyas import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, kv_cache_gb=0.01)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="model: .*does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_models, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"architectures: 'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        LLM(str(folder))


def test_kv_budget_too_small(tiny_models):
    with pytest.raises(ValueError, match=r"kv_cache_gb: 1e-05 GiB .* max_model_len=128 needs"):
        LLM(str(tiny_models["llama"]), max_model_len=128, kv_cache_gb=1e-5)
    with pytest.raises(ValueError, match=r"num_kv_blocks: 3 blocks"):
        LLM(str(tiny_models["llama"]), max_model_len=128, num_kv_blocks=3)


def test_bad_engine_settings(tiny_models):
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        LLM(str(tiny_models["llama"]), dtype="int8")
    with pytest.raises(ValueError, match=r"max_model_len: 5000 must be in \[2, 1024\]"):
        LLM(str(tiny_models["llama"]), max_model_len=5000)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), r"max_tokens=2.5 is invalid: must be an integer >= 1, or None"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt: is empty"),
    ([], "prompt: is empty"),
    ([5, 99999], r"prompt_token_ids: \[99999\] outside the vocabulary \[0, 320\)"),
    ([-1], r"prompt_token_ids: \[-1\] outside the vocabulary"),
    ([7] * 200, "prompt: 200 tokens does not fit max_model_len=128"),
])
def test_bad_prompt_leaves_engine_serving(llm, prompt, message):
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good request of the failed call was withdrawn
    after = llm.generate([[1, 2, 3], [4, 5]], good, use_tqdm=False)
    assert after[0].outputs[0].token_ids == before


def test_vllm_prompt_dicts_are_prompts_and_other_dicts_are_refused(llm):
    """vLLM's TokensPrompt and TextPrompt shapes give what token ids and text give; a dict with other keys (say
    vLLM's multi_modal_data) gets a ValueError naming them, and the engine keeps serving."""
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.generate([[5, 6, 7], "hi"], good, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "hi"}], good, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in ids]
    assert llm.generate({"prompt": "hi"}, good, use_tqdm=False)[0].prompt == "hi"
    with pytest.raises(ValueError, match=r"prompt: a dict must hold .* got keys \['multi_modal_data', 'prompt'\]"):
        llm.generate([[5, 6, 7], {"prompt": "hi", "multi_modal_data": {}}], good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_mismatched_sampling_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params: 2 given for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()], use_tqdm=False)
