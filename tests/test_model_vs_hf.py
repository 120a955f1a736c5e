"""Logits of every architecture equal HF transformers' on the same random tiny weights (fp32)."""

import pytest
import torch
import transformers

from eyas import LLM, SamplingParams
from eyas.core.step import RunnerOutput


@torch.inference_mode()
def _eyas_logits_by_chunks(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Feed the prompt through the real scheduler in chunks of ``chunk`` tokens; logits at every position."""
    engine = llm.engine
    engine.add_request("probe", token_ids, SamplingParams(max_tokens=1))
    rows = []
    while True:
        plan = engine.scheduler.schedule()
        out, _ = engine.runner.forward(plan)
        rows.append(engine.runner.model.compute_logits(out.hidden))
        engine.scheduler.commit(plan, RunnerOutput({"probe": [0]}, {}, {}, {}))
        if plan.scheduled[0].will_sample:
            break
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_prefill_and_long_cache_decode_logits_match_hf(tiny_models, arch):
    path = tiny_models[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, 320, (601,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens[:600]])).logits[0]  # [600, vocab]
    # one-shot prefill
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_gb=0.05, max_num_batched_tokens=1024)
    got = _eyas_logits_by_chunks(llm, tokens[:600])
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    # chunked prefill (64-token chunks, crossing block boundaries) then 40 one-token decode steps
    # over a long cache: every position's logits still match
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_gb=0.05, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("probe", tokens[:560], SamplingParams(max_tokens=100, ignore_eos=True))
    rows = []
    while engine.scheduler.requests["probe"].num_computed_tokens < 600:
        plan = engine.scheduler.schedule()
        out, _ = engine.runner.forward(plan)
        rows.append(engine.runner.model.compute_logits(out.hidden))
        entry = plan.scheduled[0]
        nxt = entry.start + entry.num_new_tokens
        engine.scheduler.commit(plan, RunnerOutput({"probe": [tokens[nxt]]} if entry.will_sample else {}, {}, {}, {}))
    torch.testing.assert_close(torch.cat(rows)[:600].cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_generation_matches_hf(tiny_models, arch):
    path = tiny_models[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=512, kv_cache_gb=0.05)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (1, 7, 33, 70, 16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.inference_mode()
def test_aux_hidden_states_follow_the_vllm_layer_convention(tiny_models, arch):
    """Aux id k is the residual stream entering layer k (HF hidden_states[k]); id N is the stream
    after the last layer, before the final norm; the last hidden state is HF's normed output."""
    path = tiny_models[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # N+1 tensors of [1, T, H]
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.02, max_num_batched_tokens=16)
    engine = llm.engine
    num_layers = engine.config.model.num_layers
    engine.runner.model.aux_layer_ids = (0, 2, num_layers)
    engine.add_request("probe", tokens, SamplingParams(max_tokens=1))
    aux, last = [], []
    while "probe" in engine.scheduler.requests:  # 16-token chunks
        plan = engine.scheduler.schedule()
        out, _ = engine.runner.forward(plan)
        aux.append(out.aux_hidden)
        last.append(out.hidden)
        engine.scheduler.commit(plan, RunnerOutput({"probe": [0]} if plan.scheduled[0].will_sample else {}, {}, {}, {}))
    aux, last = torch.cat(aux).cpu(), torch.cat(last).cpu()  # [T, 3, H], [T, H]
    # HF's last hidden_states entry is already normed; the pre-norm stream N is checked through its norm
    torch.testing.assert_close(aux[:, 0], ref[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux[:, 1], ref[2][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(engine.runner.model.norm(aux[:, 2].to(engine.runner.device)).cpu(), ref[num_layers][0],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, ref[num_layers][0], rtol=1e-4, atol=1e-4)
