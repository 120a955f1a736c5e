"""The extract_hidden_states method: dumps equal HF transformers' hidden states, under every scheduling path."""

import re

import pytest
import torch
import transformers
from engine_helpers import run_counting_preemptions
from safetensors import safe_open
from safetensors.torch import load_file

from eyas import LLM, SamplingParams
from eyas.data.hidden_states_writer import HiddenStatesWriter

N = 3  # layers of the tiny models
IDS = [2, 0, N]  # the stream entering layer 2, embeddings, after the last layer (before the final norm); dumps
# keep the configured order


def _spec(out, **over):
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1, "aux_layer_ids": IDS,
            "output_dir": str(out), **over}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def _hf_states(hf, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, len(IDS), hidden] from HF; HF's last entry is after the final norm, so ours at id N
    is compared after applying the same norm (see _normed)."""
    states = hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    return torch.stack([states[i][0] for i in IDS], dim=1)


def _normed(hf, dumped: torch.Tensor) -> torch.Tensor:
    out = dumped.clone()
    with torch.inference_mode():
        out[:, IDS.index(N)] = hf.model.norm(dumped[:, IDS.index(N)])
    return out


@pytest.fixture(scope="module")
def hf_llama(tiny_models):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


@pytest.mark.parametrize("include_output", [False, True])
def test_dumps_equal_hf_with_chunked_prefill_preemption_and_prefix_cache(tiny_models, hf_llama, tmp_path,
                                                                          include_output):
    prompts = _prompts([7, 70, 33, 130, 1, 64])
    prompts.append(prompts[3][:96] + _prompts([20], seed=5)[0])  # shares 6 full blocks with prompt 3
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256, num_kv_blocks=26, block_size=16,
              max_num_batched_tokens=48, speculative_config=_spec(tmp_path, include_output_tokens=include_output))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs, preemptions = run_counting_preemptions(llm, prompts, params)
    assert preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outs)  # the prefix cache served some blocks
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"req-{i}.safetensors" for i in range(len(prompts)))  # no temporary files left
    for prompt, out in zip(prompts, outs):
        dump = load_file(out.hidden_states_path)
        expected_ids = prompt + out.outputs[0].token_ids[:-1] if include_output else prompt
        assert dump["token_ids"].dtype == torch.int64 and dump["token_ids"].tolist() == expected_ids
        assert dump["hidden_states"].shape == (len(expected_ids), len(IDS), 64)
        torch.testing.assert_close(_normed(hf_llama, dump["hidden_states"]), _hf_states(hf_llama, expected_ids),
                                   rtol=1e-4, atol=1e-4)
    with safe_open(outs[0].hidden_states_path, "pt") as f:
        meta = f.metadata()
    assert meta["aux_layer_ids"] == "2,0,3" and meta["layer_convention"] == "vllm" and meta["dtype"] == "float32"


def test_greedy_outputs_are_unchanged_by_extraction(tiny_models, tmp_path):
    prompts = _prompts([9, 40, 75])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    extract = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02,
                  speculative_config=_spec(tmp_path))
    assert ([o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in extract.generate(prompts, params, use_tqdm=False)])


def test_aborted_request_leaves_no_file_and_others_finish(tiny_models, tmp_path):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02,
              speculative_config=_spec(tmp_path))
    engine = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i, p in enumerate(_prompts([20, 30])):
        engine.add_request(f"r{i}", p, params)
    engine.step()
    engine.abort_request("r0")
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r1.safetensors"]


@pytest.mark.parametrize(("over", "message"), [
    ({"num_speculative_tokens": 2}, "num_speculative_tokens: method 'extract_hidden_states' needs 1"),
    ({"aux_layer_ids": None}, "aux_layer_ids: method 'extract_hidden_states' needs the layer ids"),
    ({"aux_layer_ids": []}, "aux_layer_ids: method 'extract_hidden_states' needs the layer ids"),
    ({"aux_layer_ids": [1, 1]}, "aux_layer_ids: [1, 1] has repeated ids"),
    ({"aux_layer_ids": [0, 4]}, "aux_layer_ids: 4 is outside [0, 3]"),
    ({"aux_layer_ids": "2,3"}, "must be a list of layer ids"),
    ({"output_dir": None}, "output_dir: method 'extract_hidden_states' needs a folder"),
    ({"prompt_lookup_max": 5}, "prompt_lookup_max: not used by method 'extract_hidden_states'"),
])
def test_misconfigurations_name_the_field(tiny_models, tmp_path, over, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02,
            speculative_config=_spec(tmp_path, **over))


def test_output_dir_that_is_a_file_is_refused(tiny_models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="output_dir: cannot write to"):
        LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256, kv_cache_gb=0.02,
            speculative_config=_spec(blocker))


def test_other_methods_refuse_extraction_options(tmp_path):
    from eyas.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="output_dir: not used by method 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "output_dir": str(tmp_path)})


def test_writer_surfaces_errors_and_applies_back_pressure(tmp_path):
    writer = HiddenStatesWriter(tmp_path / "out", num_threads=1, max_pending=2)
    for i in range(6):  # more than max_pending: submit blocks until the worker catches up
        writer.submit(f"s{i}", {"x": torch.full((4,), float(i))})
    writer.flush()
    assert [load_file(tmp_path / "out" / f"s{i}.safetensors")["x"][0].item() for i in range(6)] == list(range(6))
    with pytest.raises(ValueError, match="cannot name a file"):
        writer.submit("../escape", {"x": torch.zeros(1)})
    (tmp_path / "out").rename(tmp_path / "moved")  # the folder disappears under the writer
    writer.submit("lost", {"x": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="hidden-state writer failed"):
        writer.flush()
