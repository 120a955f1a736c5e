"""A parallel (P-EAGLE) drafter on the real default model, through the GGUF CPU kernels (its matrices as int8
rows beside them): greedy output token-identical to no speculation, and seeded sampling token-identical under
shared noise. The drafter is the shipped chain drafter made parallel (depth 0 as trained; a random
``mask_hidden``), so depths >= 1 draft poorly and verification rejects them: what must hold is the output."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas import LLM, SamplingParams
from eyas.data.prompts import HELD_OUT_START, chat_prompts
from eyas.drafters import shipped_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parallel_folder(tmp_path_factory):
    chain = shipped_drafter("eagle3")
    folder = tmp_path_factory.mktemp("peagle")
    tensors = load_file(chain / "model.safetensors")
    width = tensors["fc.weight"].shape[1]  # 3 aux states of the target
    tensors["mask_hidden"] = (torch.randn(1, width, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((chain / "config.json").read_text()) | {"ptd_token_id": 0, "parallel_drafting_depths": 4}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_parallel_drafter_on_the_real_model_is_lossless(parallel_folder):
    plain = LLM(max_num_seqs=4)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in chat_prompts(2, start=HELD_OUT_START)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=24) for s in (1, 2)]
    want_greedy = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    want_seeded = [o.outputs[0].token_ids for o in plain.generate(prompts, seeded, use_tqdm=False)]
    del plain
    spec = {"method": "eagle3", "parallel_drafting": True, "model": parallel_folder, "num_speculative_tokens": 4,
            "adaptive_draft_length": False}
    llm = LLM(max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want_greedy
    stats = llm.stats()
    assert stats["num_drafted"] > 0 and stats["mean_acceptance_length"] > 1.2, stats  # depth 0 is the trained one
    noise = LLM(max_num_seqs=4, speculative_config=spec | {"verification": "shared_noise"})
    assert [o.outputs[0].token_ids for o in noise.generate(prompts, seeded, use_tqdm=False)] == want_seeded
