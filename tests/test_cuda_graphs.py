"""The CUDA-graph step runner: its batch-size ladder, and capture-then-replay with fresh inputs."""

from __future__ import annotations

import pytest
import torch

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
