"""The CUDA-graph step runner (its batch-size ladder, capture-then-replay with fresh inputs) and the target
forward on the uniform layout it replays."""

from __future__ import annotations

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.runner.cuda_graphs import StepGraphs, batch_size_ladder


def test_ladder_covers_the_largest_batch_with_little_padding():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_size_ladder(30) == [1, 2, 4, 8, 16, 24, 32]
    graphs = StepGraphs(torch.device("cpu"), 30, capture=False)
    assert [graphs.padded_batch_size(n) for n in (1, 3, 5, 9, 17, 25, 32, 33)] == [1, 4, 8, 16, 24, 32, 32, None]


def test_eager_mode_runs_the_function_as_is():
    graphs = StepGraphs(torch.device("cpu"), 8, capture=False)
    out = graphs.run("k", lambda x: (x * 2,), torch.arange(3))
    assert out[0].tolist() == [0, 2, 4] and graphs.num_graphs == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_reads_new_inputs_and_keeps_each_key_apart():
    dev = torch.device("cuda")
    graphs = StepGraphs(dev, 8, capture=True)
    weight = torch.randn(16, 16, device=dev)

    def step(x, idx):
        return (x @ weight + idx[:, None],)

    for _ in range(3):
        for rows in (2, 4):
            x, idx = torch.randn(rows, 16, device=dev), torch.randint(0, 9, (rows,), device=dev)
            got = graphs.run(("step", rows), step, x, idx)[0].clone()
            torch.testing.assert_close(got, x @ weight + idx[:, None])
    assert graphs.num_graphs == 2


def _target_batch():
    """7 requests of mixed prompt lengths (the long ones chunked) and lengths; greedy and seeded."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for n in (5, 40, 17, 70, 3, 33, 50):
        p = torch.randint(0, 256, (n,), generator=g).tolist()
        prompts.append(p + p[: n // 2])  # repeats give the n-gram matcher drafts to verify
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate((4, 9, 14, 6, 20, 11, 17))]
    return prompts, params


def _target_llm(folder, spec, **over):
    kw = dict(dtype="float32", max_model_len=256, kv_cache_gb=0.05, max_num_batched_tokens=48)
    if spec:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "verification": "shared_noise"}
    return LLM(str(folder), **{**kw, **over})


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_target_uniform_layout_run_eagerly_gives_the_flat_outputs(tiny_models, spec):
    """The target forward on the layout CUDA graphs replay (requests padded to 1 or k+1 rows, the batch up the
    ladder, block tables to a power of two), run eagerly on the CPU, gives the flat layout's tokens."""
    prompts, params = _target_batch()
    want = [o.outputs[0].token_ids for o in _target_llm(tiny_models["llama"], spec).generate(prompts, params,
                                                                                             use_tqdm=False)]
    llm = _target_llm(tiny_models["llama"], spec)
    runner = llm.engine.runner
    runner.graphs = StepGraphs(torch.device("cpu"), 64, capture=False)
    keys, original = [], runner.graphs.run

    def recording(key, fn, *inputs):
        keys.append(key)
        return original(key, fn, *inputs)

    runner.graphs.run = recording
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert {2, 4, 8} <= {size for _, size, _, _ in keys}  # 7, 5, 3 requests decoding were padded up
    assert {width for _, _, width, _ in keys} == ({1, 4} if spec else {1})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_target_cuda_graphs_give_the_eager_outputs(tiny_models, spec):
    prompts, params = _target_batch()
    eager = _target_llm(tiny_models["llama"], spec, device="cuda", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = _target_llm(tiny_models["llama"], spec, device="cuda")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.runner.graphs.num_graphs > 0
