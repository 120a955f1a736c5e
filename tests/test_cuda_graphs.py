"""The CUDA-graph step runner (its batch-size ladder, capture-then-replay with fresh inputs) and the target
forward on the uniform layout it replays."""

from __future__ import annotations

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.model.cuda_graphs import StepGraphs, batch_size_ladder


def test_ladder_covers_the_largest_batch_with_little_padding():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_size_ladder(30) == [1, 2, 4, 8, 16, 24, 32]
    graphs = StepGraphs(torch.device("cpu"), 30, capture=False)
    assert [graphs.padded_batch_size(n) for n in (1, 3, 5, 9, 17, 25, 32, 33)] == [1, 4, 8, 16, 24, 32, 32, None]


def test_uniform_shape_takes_decodes_and_verifications_but_not_prompt_chunks():
    graphs = StepGraphs(torch.device("cpu"), 30, capture=False)
    assert graphs.uniform_shape(3, 1, k=3) == (1, 4)  # plain decodes: one row each, 3 requests padded to 4
    assert graphs.uniform_shape(3, 2, k=3) == (4, 4)  # some request verifies drafts: k + 1 rows each
    assert graphs.uniform_shape(3, 5, k=3) is None  # a query longer than k + 1 is a prompt chunk
    assert graphs.uniform_shape(3, 2, k=0) is None  # without speculation only decodes are uniform
    assert graphs.uniform_shape(33, 1, k=3) is None  # above the ladder


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


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "qwen3"},
    "self_draft": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
}


def _target_llm(models, case, **over):
    kw = dict(dtype="float32", max_model_len=256, kv_cache_gb=0.05, max_num_batched_tokens=48)
    if SPECS[case]:
        spec = {**SPECS[case], "verification": "shared_noise"}
        if "model" in spec:
            spec["model"] = str(models[spec["model"]])
        kw["speculative_config"] = spec
    return LLM(str(models["llama"]), **{**kw, **over})


def _run(llm, prompts, params) -> tuple[list, list]:
    """(the outputs' token ids, every step's drafts): drafts too, since verification hides wrong ones."""
    steps, proposer = [], llm.engine.runner.proposer
    if proposer is not None:
        original = proposer.propose

        def recording(inp):
            out = original(inp)
            steps.append(out.draft_token_ids.tolist())
            return out

        proposer.propose = recording
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], steps


def _record_keys(graphs: StepGraphs) -> list:
    keys, original = [], graphs.run

    def recording(key, fn, *inputs):
        keys.append(key)
        return original(key, fn, *inputs)

    graphs.run = recording
    return keys


@pytest.mark.parametrize("case", list(SPECS))
def test_uniform_layouts_run_eagerly_give_the_flat_outputs(tiny_models, case):
    """The target and draft-model forwards on the layouts CUDA graphs replay (requests padded to 1 or k+1
    rows, the batch up the ladder, block tables to a power of two), run eagerly on the CPU, give the flat
    layout's tokens, greedy and seeded."""
    prompts, params = _target_batch()
    want = _run(_target_llm(tiny_models, case), prompts, params)
    llm = _target_llm(tiny_models, case)
    runner = llm.engine.runner
    runner.graphs = StepGraphs(torch.device("cpu"), 64, capture=False)
    keys = _record_keys(runner.graphs)
    proposer_keys = []
    if hasattr(runner.proposer, "graphs"):
        runner.proposer.graphs = StepGraphs(torch.device("cpu"), 64, capture=False)
        proposer_keys = _record_keys(runner.proposer.graphs)
    assert _run(llm, prompts, params) == want
    sizes = {size for _, size, _, _ in keys}
    assert {4, 8} <= sizes <= {1, 2, 4, 8}  # 7, 5, 3 requests decoding were padded up the ladder
    widths = {width for _, _, width, _ in keys}
    assert widths == {1} if case == "plain" else 4 in widths and widths <= {1, 4}  # k + 1 rows to verify drafts
    if case == "draft_model":
        assert {"catch_up", "decode"} == {key[0] for key in proposer_keys}
    if case == "self_draft":
        assert {"decode"} == {key[0] for key in proposer_keys}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(SPECS))
def test_cuda_graphs_give_the_eager_outputs(tiny_models, case):
    prompts, params = _target_batch()
    eager = _target_llm(tiny_models, case, device="cuda", enforce_eager=True)
    want = _run(eager, prompts, params)
    llm = _target_llm(tiny_models, case, device="cuda")
    assert _run(llm, prompts, params) == want
    assert llm.engine.runner.graphs.num_graphs > 0
    if hasattr(llm.engine.runner.proposer, "graphs"):
        assert llm.engine.runner.proposer.graphs.num_graphs > 0
