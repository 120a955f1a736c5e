"""SamplingParams validation, counter-based noise, and the seeded sampler's exact distribution.

Statistical tests use fixed seeds (so they are deterministic) and reject at significance
ALPHA = 1e-3: a correct implementation fails one such test with probability 1e-3 per seed
choice, while a wrong distribution at these sample sizes (>= 1e5 draws) fails essentially
always.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from stats_helpers import chi2_pvalue

from eyas.sampling.noise import gumbel, uniform
from eyas.sampling.params import SamplingParams
from eyas.sampling.row_ops import gumbel_argmax
from eyas.sampling.sampler import Sampler, SamplingBatch, log_probabilities, probabilities

ALPHA = 1e-3




# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [1, -5]}, "stop_token_ids"),
    ],
)
def test_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kwargs)
    assert repr(kwargs[field]) in str(err.value) or str(kwargs[field]) in str(err.value)


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and not p.greedy
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(top_k=-1, logprobs=0, stop_token_ids=[0, 7]).top_k == -1


# ---------------------------------------------------------------------------- noise


def _grid(num_seeds: int, num_positions: int):
    seeds = torch.arange(num_seeds).repeat_interleave(num_positions)
    positions = torch.arange(num_positions).repeat(num_seeds)
    return seeds, positions


def test_uniform_is_uniform_and_open_interval():
    seeds, positions = _grid(50, 40)
    u = uniform(seeds, positions, 0, 100)  # 2e5 numbers
    assert u.dtype == torch.float32 and u.shape == (2000, 100)
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > ALPHA
    g = gumbel(seeds, positions, 100)
    assert stats.kstest(g.flatten().double().numpy(), "gumbel_r").pvalue > ALPHA


def test_uniform_extreme_seeds_and_positions():
    seeds = torch.tensor([0, -1, 2**62, -(2**63), 2**63 - 1])
    u = uniform(seeds, torch.tensor([0, 2**40, 5, 1, 2**31]), 3, 16)
    assert 0 < u.min() and u.max() < 1 and u.unique().numel() == u.numel()


@pytest.mark.parametrize("what", ["position", "stream", "seed", "column"])
def test_uniform_independence(what):
    seeds, positions = _grid(100, 100)
    a = uniform(seeds, positions, 1, 64)
    if what == "position":
        b = uniform(seeds, positions + 1, 1, 64)
    elif what == "stream":
        b = uniform(seeds, positions, 2, 64)
    elif what == "seed":
        b = uniform(seeds + 1, positions, 1, 64)
    else:
        b = a.roll(1, dims=1)
    x, y = a.flatten().double().numpy(), b.flatten().double().numpy()
    # correlation of independent uniforms ~ N(0, 1/n): 5 sigma bound
    assert abs(np.corrcoef(x, y)[0, 1]) < 5 / math.sqrt(x.size)
    # and no shared values beyond chance
    assert np.mean(x == y) < 1e-3


def test_uniform_rows_depend_only_on_own_seed_and_position():
    seeds = torch.tensor([3, 3, 9, 1234567890123, 3])
    positions = torch.tensor([0, 1, 0, 77, 0])
    full = uniform(seeds, positions, 1, 33)
    assert torch.equal(full, uniform(seeds, positions, 1, 33))  # deterministic
    assert torch.equal(full[0], full[4])
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(uniform(seeds[perm], positions[perm], 1, 33), full[perm])
    for i in range(5):
        assert torch.equal(uniform(seeds[i : i + 1], positions[i : i + 1], 1, 33)[0], full[i])
    # a per-row stream tensor equals the per-stream calls
    streams = torch.tensor([0, 2, 1, 0, 2])
    mixed = uniform(seeds, positions, streams, 33)
    for s in (0, 1, 2):
        rows = streams == s
        assert torch.equal(mixed[rows], uniform(seeds, positions, s, 33)[rows])


@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000])
def test_gumbel_argmax_kernel_equals_the_noise_tensors(width):
    """The CPU kernel (``token_ops.c``) against argmax(logprobs + gumbel(...)) built from the noise tensors:
    full rows, rows masked as top-p leaves them (blocks of -inf skipped), a row of -inf (0, as argmax), a
    NaN (the first one), extreme seeds, a stream per row; 1 and 2 threads, a row alone and in 300."""
    gen = torch.Generator().manual_seed(width)
    rows = 300
    logprobs = torch.randn(rows, width, generator=gen)
    logprobs[100:200] = logprobs[100:200].masked_fill(logprobs[100:200] < 1.0, -math.inf)
    logprobs[200:250, 1:] = -math.inf
    logprobs[3] = -math.inf
    logprobs[4, width // 2] = math.nan
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    seeds[:2] = torch.tensor([2**63 - 1, -(2**63)])
    positions = torch.randint(0, 2**40, (rows,), generator=gen)
    streams = torch.randint(0, 4, (rows,), generator=gen)
    before = torch.get_num_threads()
    try:
        for stream in (0, 2, streams):
            want = (gumbel(seeds, positions, width, stream) + logprobs).argmax(dim=-1)
            assert int(want[3]) == 0 and int(want[4]) == width // 2
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(gumbel_argmax(logprobs, seeds, positions, stream), want)
            row_streams = streams[7:8] if isinstance(stream, torch.Tensor) else stream
            assert int(gumbel_argmax(logprobs[7:8], seeds[7:8], positions[7:8], row_streams)[0]) == want[7]
    finally:
        torch.set_num_threads(before)


def test_probabilities_flush_only_what_float32_cannot_hold_normally():
    """exp and log as PyTorch's, except below e^EXP_FLOOR (float32's subnormals), which is 0 / -inf."""
    logprobs = torch.tensor([0.0, -1.5, -80.0, -86.9, -87.5, -100.0, -math.inf])
    want = torch.tensor([1.0, math.exp(-1.5), math.exp(-80.0), math.exp(-86.9), 0.0, 0.0, 0.0])
    torch.testing.assert_close(probabilities(logprobs), want, rtol=2e-6, atol=0)  # exp loses bits near 1e-38
    probs = torch.tensor([1.0, 0.25, 1e-30, 1e-39, 0.0])
    got = log_probabilities(probs)
    torch.testing.assert_close(got[:3], probs[:3].log(), rtol=1e-7, atol=0)
    assert got[3:].tolist() == [-math.inf, -math.inf]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_and_sampling_same_on_cuda():
    seeds, positions = _grid(16, 8)
    cpu_u = uniform(seeds, positions, 2, 1000)
    assert torch.equal(cpu_u, uniform(seeds.cuda(), positions.cuda(), 2, 1000).cpu())
    logits = torch.randn(128, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)] * 128

    def run(device):
        batch = SamplingBatch.from_params(params, seeds.tolist(), positions.tolist(), device)
        return Sampler().sample(logits.to(device), batch).token_ids.cpu()

    assert torch.equal(run("cpu"), run("cuda"))


# ---------------------------------------------------------------------------- processed distribution


def naive_processed_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Per-row reference of the documented order: temperature, top-k, top-p, min-p."""
    logits = logits.astype(np.float64)
    if p.greedy:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits / p.temperature
    keep = np.ones(len(x), dtype=bool)
    if p.top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
    if p.top_p < 1:
        order = np.argsort(-x)
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        mass_before = 0.0
        smallest_kept = np.inf
        for i in order:
            if not keep[i] or mass_before >= p.top_p:
                break
            smallest_kept = x[i]
            mass_before += probs[i]
        keep &= x >= smallest_kept
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def _random_params(rng: np.random.Generator, n: int) -> list[SamplingParams]:
    out = []
    for _ in range(n):
        out.append(
            SamplingParams(
                temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])),
                top_k=int(rng.choice([-1, 0, 1, 3, 10, 40])),
                top_p=float(rng.choice([1.0, 0.95, 0.6, 0.2])),
                min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
            )
        )
    return out


def test_processed_logprobs_match_naive_reference():
    rng = np.random.default_rng(0)
    n, vocab = 200, 60
    logits = torch.tensor(rng.normal(0, 2, (n, vocab)), dtype=torch.float32)
    params = _random_params(rng, n)
    batch = SamplingBatch.from_params(params, list(range(n)), [0] * n, "cpu")
    got = Sampler().processed_logprobs(logits, batch).exp().double().numpy()
    for i in range(n):
        want = naive_processed_probs(logits[i].numpy(), params[i])
        np.testing.assert_allclose(got[i], want, atol=1e-5, err_msg=f"row {i}: {params[i]}")


def test_processed_logprobs_batch_invariant_and_keeps_boundary_ties():
    # Rounded logits have many ties; a row's result must not depend on the other rows
    # (with only top-k rows the sampler sorts just max(top_k) candidates).
    rng = np.random.default_rng(1)
    logits = torch.tensor(np.round(rng.normal(0, 1, (8, 300)), 1), dtype=torch.float32)
    params = [SamplingParams(top_k=k, top_p=p) for k, p in zip([5, 20, 7, 3, 50, 2, 9, 12], [1, 0.5, 0.9] * 3)]
    sampler = Sampler()
    alone = sampler.processed_logprobs(logits, SamplingBatch.from_params(params, [0] * 8, [0] * 8, "cpu"))
    mixed = sampler.processed_logprobs(
        torch.cat([logits, logits[:1]]),
        SamplingBatch.from_params(params + [SamplingParams()], [0] * 9, [0] * 9, "cpu"),
    )
    assert torch.equal(alone, mixed[:8])
    for i, p in enumerate(params):
        kth = logits[i].sort(descending=True).values[p.top_k - 1]
        kept = alone[i] > -math.inf
        assert kept.sum() >= min(p.top_k, 1)
        assert torch.all(kept[logits[i] > kth] | (p.top_p < 1))
        if p.top_p == 1:
            assert torch.equal(kept, logits[i] >= kth)  # every token tied with the k-th is kept
        np.testing.assert_allclose(alone[i].exp().numpy(), naive_processed_probs(logits[i].numpy(), p), atol=1e-5)


@pytest.mark.parametrize("width", [64, 1024])
def test_nucleus_thresholds_kernel_equals_the_tensor_form(width, monkeypatch):
    """token_ops.c's nucleus against ``_thresholds``' tensor ops: the same threshold and settled flag for rows
    that top-k, top-p, both or neither decide, inside the width or past it, at temperatures 0.2 and 1, with
    ties and -inf among the values; one row alone equals it in the batch."""
    from eyas.sampling import sampler as sampler_module

    rng = np.random.default_rng(width)
    vocab, n = 49152, 24
    x = torch.tensor(rng.normal(0, 3, (n, vocab)), dtype=torch.float32)
    x[:12] /= 0.2
    x[3] = x[3].round()  # ties
    x[4, ::5] = -math.inf
    x[5] = torch.tensor(rng.normal(0, 0.3, vocab), dtype=torch.float32)  # flat: the nucleus reaches past the width
    k = torch.tensor(rng.choice([vocab, vocab, 1, 5, 40, 3000], n), dtype=torch.int64)
    top_p = torch.tensor(rng.choice([1.0, 0.95, 0.9, 0.5], n), dtype=torch.float32)
    k[0], top_p[0] = vocab, 1.0  # neither
    got = sampler_module._thresholds(x, k, top_p, width, True)
    assert torch.equal(sampler_module._thresholds(x[7:8], k[7:8], top_p[7:8], width, True)[0], got[0][7:8])
    monkeypatch.setattr(sampler_module, "nucleus_thresholds", lambda *args: None)
    want = sampler_module._thresholds(x, k, top_p, width, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not got[1].all() and got[1].any()  # rows settled and rows left for a wider sort


def test_processed_logprobs_without_the_c_kernels_equal_them(monkeypatch, tmp_path):
    """The tensor forms (CUDA's path, and a CPU's without a C compiler) against token_ops.c's kernels on a
    49,152-token batch of mixed settings: the same tokens kept, the same log-probabilities within float32
    rounding (the kernels' exp and sums are their own)."""
    from kernel_helpers import without_c_compiler

    from eyas.kernels import token_ops

    rng = np.random.default_rng(5)
    n = 40
    logits = torch.tensor(rng.normal(0, 3, (n, 49152)), dtype=torch.float32)
    params = _random_params(rng, n)
    batch = SamplingBatch.from_params(params, list(range(n)), [0] * n, "cpu")
    native = Sampler().processed_logprobs(logits, batch)
    with without_c_compiler(monkeypatch, tmp_path, token_ops.token_ops):
        assert token_ops.token_ops() is None
        tensors = Sampler().processed_logprobs(logits, batch)
    assert torch.equal(native.isinf(), tensors.isinf())
    torch.testing.assert_close(native, tensors, rtol=1e-5, atol=1e-5)


def test_top_p_over_a_large_vocabulary_equals_a_full_sort():
    # The sampler sorts only the best 64 values, then 1,024, then 8,192, then the whole vocabulary, as far as
    # each row's top-k or nucleus reaches; rows of every reach must equal the naive reference, alone or batched.
    # (These widths take token_ops.c's top_values, the whole vocabulary PyTorch's topk.)
    rng = np.random.default_rng(2)
    vocab = 20000
    rows = [(4.0, SamplingParams(top_p=0.95)),  # nucleus ~300 tokens: the second width
            (3.0, SamplingParams(top_p=0.95)),  # ~2,000: the third
            (1.0, SamplingParams(top_p=0.95)),  # ~15,000: the whole vocabulary
            (1.0, SamplingParams(top_k=3000)),  # a top-k past the first width
            (1.0, SamplingParams(top_k=12000, top_p=0.9)),  # past the second
            (2.0, SamplingParams(temperature=0.5, top_p=0.6)),
            (1.0, SamplingParams()),
            (2.0, SamplingParams(temperature=0)),
            (9.0, SamplingParams(top_p=0.9))]  # a few tokens: the first width
    logits = torch.tensor(np.stack([rng.normal(0, scale, vocab) for scale, _ in rows]), dtype=torch.float32)
    logits[5, :4000] = logits[5, :4000].round()  # ties
    params = [p for _, p in rows]
    sampler = Sampler()
    together = sampler.processed_logprobs(logits, SamplingBatch.from_params(params, [0] * 9, [0] * 9, "cpu"))
    kept_counts = []
    for i, p in enumerate(params):
        alone = sampler.processed_logprobs(logits[i:i + 1], SamplingBatch.from_params([p], [0], [0], "cpu"))[0]
        assert torch.equal(alone, together[i]), f"row {i}: depends on the batch"
        want = naive_processed_probs(logits[i].numpy(), p)
        kept = (together[i] > -math.inf).numpy()
        assert np.array_equal(kept, want > 0), f"row {i}: {p}: kept {kept.sum()} tokens, reference {(want > 0).sum()}"
        np.testing.assert_allclose(together[i].exp().numpy(), want, atol=1e-6, err_msg=f"row {i}: {p}")
        kept_counts.append(int(kept.sum()))
    assert kept_counts[8] < 64 < kept_counts[0] < 1024 < kept_counts[1] < 8192 < kept_counts[2]  # every width


def test_greedy_rows_are_one_hot():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=0, top_p=0.5)]
    batch = SamplingBatch.from_params(params, [1, 2, 3, 4], [5, 6, 7, 8], "cpu")
    lp = Sampler().processed_logprobs(logits, batch)
    for i in (0, 1, 3):
        assert lp[i].argmax() == logits[i].argmax() and lp[i].max() == 0 and (lp[i] == 0).sum() == 1
        assert torch.isinf(lp[i]).sum() == 99
    assert torch.allclose(lp[2], torch.log_softmax(logits[2], -1))
    out = Sampler().sample(logits, batch).token_ids
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]].argmax(-1))


# ---------------------------------------------------------------------------- sampling statistics


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.02),
    ],
    ids=["plain", "temp", "topk", "topp", "minp", "all"],
)
def test_sample_frequencies_match_processed_distribution(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
    seeds, positions = _grid(400, 300)  # 1.2e5 draws: each seed at many positions
    n = seeds.numel()
    batch = SamplingBatch.from_params([params] * n, seeds.tolist(), positions.tolist(), "cpu")
    tokens = Sampler().sample(logits.expand(n, -1), batch).token_ids
    want = naive_processed_probs(logits.numpy(), params)
    assert chi2_pvalue(tokens, want) > ALPHA


def test_sample_is_batch_invariant_and_seed_dependent():
    rng = np.random.default_rng(2)
    n, vocab = 24, 2000
    logits = torch.tensor(rng.normal(0, 3, (n, vocab)), dtype=torch.float32)
    params = _random_params(rng, n)
    seeds = rng.integers(0, 2**62, n).tolist()
    positions = rng.integers(0, 4096, n).tolist()
    sampler = Sampler()
    full = sampler.sample(logits, SamplingBatch.from_params(params, seeds, positions, "cpu")).token_ids
    perm = rng.permutation(n)
    shuffled = sampler.sample(
        logits[perm],
        SamplingBatch.from_params([params[i] for i in perm], [seeds[i] for i in perm], [positions[i] for i in perm], "cpu"),
    ).token_ids
    assert torch.equal(shuffled, full[perm])
    for i in range(n):
        alone = sampler.sample(logits[i : i + 1], SamplingBatch.from_params([params[i]], [seeds[i]], [positions[i]], "cpu"))
        assert alone.token_ids.item() == full[i].item()
    # same logits, different seeds or positions -> different tokens (flat distribution)
    flat = torch.zeros(1, vocab).expand(64, -1)
    one = [SamplingParams()] * 64
    by_seed = sampler.sample(flat, SamplingBatch.from_params(one, list(range(64)), [0] * 64, "cpu")).token_ids
    by_pos = sampler.sample(flat, SamplingBatch.from_params(one, [0] * 64, list(range(64)), "cpu")).token_ids
    assert by_seed.unique().numel() > 55 and by_pos.unique().numel() > 55


def test_sample_uses_gumbel_argmax_on_processed_logprobs():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * 16
    batch = SamplingBatch.from_params(params, list(range(16)), list(range(100, 116)), "cpu")
    sampler = Sampler()
    want = gumbel_argmax(sampler.processed_logprobs(logits, batch), batch.seeds, batch.positions)
    assert torch.equal(sampler.sample(logits, batch).token_ids, want)


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.5, top_k=5, logprobs=4), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    sampler = Sampler()
    out = sampler.sample(logits, SamplingBatch.from_params(params, [1, 2, 3], [0, 0, 0], "cpu"))
    raw = torch.log_softmax(logits, -1)
    lp = out.logprobs
    assert lp.top_token_ids.shape == (3, 4) and lp.top_logprobs.shape == (3, 4)
    assert torch.allclose(lp.sampled_logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top = raw.topk(4, -1)
    assert torch.equal(lp.top_token_ids, top.indices) and torch.allclose(lp.top_logprobs, top.values)
    only_sampled = sampler.sample(logits[2:], SamplingBatch.from_params(params[2:], [3], [0], "cpu")).logprobs
    assert only_sampled.top_token_ids.shape == (1, 0) and only_sampled.sampled_logprobs.shape == (1,)
    assert sampler.sample(logits, SamplingBatch.from_params([SamplingParams()] * 3, [1, 2, 3], [0] * 3, "cpu")).logprobs is None
