"""Rejection sampling and shared-noise verification are lossless.

Statistical tests: fixed seeds, >= 1e5 verified rows each (one row per seed), chi-square
goodness of fit rejected at significance ALPHA = 1e-3.
"""

import itertools

import numpy as np
import pytest
import torch
from stats_helpers import chi2_pvalue

from eyas.sampling.params import SamplingParams
from eyas.sampling.rejection import greedy_verify, rejection_sample, shared_noise_verify
from eyas.sampling.row_ops import gumbel_argmax
from eyas.sampling.sampler import Sampler, SamplingBatch

ALPHA = 1e-3
R = 100_000
V = 8




def _dist(seed: int, vocab: int = V, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(vocab, generator=g) + 0.05
    p[torch.randperm(vocab, generator=g)[:zeros]] = 0
    return p / p.sum()


def _draw(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    return torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def _single_step(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor):
    """k=1 verification of one draft per row against fixed p (position 0) and p (bonus)."""
    target = p.log().expand(R, 2, V)
    draft_probs = None if q is None else q.expand(R, 1, V)
    seeds = torch.arange(R) * 7919 + 11
    positions = torch.tensor([40, 41]).expand(R, 2)
    return rejection_sample(target, drafts[:, None], draft_probs, seeds, positions, torch.ones(R, dtype=torch.int64))


def test_first_token_follows_target_and_acceptance_is_one_minus_tv():
    p, q = _dist(0), _dist(1)
    res = _single_step(p, q, _draw(q, R, 2))
    assert chi2_pvalue(res.output_tokens[:, 0], p.double().numpy()) > ALPHA
    tv = 0.5 * (p - q).abs().sum().item()
    rate = res.num_accepted.double().mean().item()
    # binomial std at R=1e5 is < 0.0016; tolerance 0.01 is > 6 sigma
    assert abs(rate - (1 - tv)) < 0.01, (rate, 1 - tv)
    assert torch.all((res.output_tokens[:, 1] == -1) == (res.num_accepted == 0))


def test_sparse_target_and_draft():
    p, q = _dist(3, zeros=3), _dist(4, zeros=2)
    res = _single_step(p, q, _draw(q, R, 5))
    assert chi2_pvalue(res.output_tokens[:, 0], p.double().numpy()) > ALPHA


def test_disjoint_draft_is_always_rejected():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    q = torch.tensor([0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25])
    res = _single_step(p, q, _draw(q, R, 6))
    assert torch.all(res.num_accepted == 0)
    assert torch.all(res.output_tokens[:, 1:] == -1)
    assert chi2_pvalue(res.output_tokens[:, 0], p.double().numpy()) > ALPHA


def test_draft_equal_to_target_is_always_accepted_and_bonus_is_plain_sample():
    p = _dist(7)
    res = _single_step(p, p, _draw(p, R, 8))
    assert torch.all(res.num_accepted == 1)
    bonus = res.output_tokens[:, 1]
    assert chi2_pvalue(bonus, p.double().numpy()) > ALPHA
    seeds = torch.arange(R) * 7919 + 11
    plain = gumbel_argmax(p.log().expand(R, V), seeds, torch.full((R,), 41))
    assert torch.equal(bonus, plain)


def test_one_hot_drafts():
    p = _dist(9)
    drafts = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(10))
    res = _single_step(p, None, drafts)
    assert chi2_pvalue(res.output_tokens[:, 0], p.double().numpy()) > ALPHA
    # a one-hot draft x is accepted with probability p(x)
    rate = res.num_accepted.double().mean().item()
    assert abs(rate - p[drafts].double().mean().item()) < 0.01


def test_greedy_target_is_exact_match():
    logits = torch.randn(64, 4, 30, generator=torch.Generator().manual_seed(11))
    argmax = logits.argmax(-1)  # [64, 4]
    target = torch.full_like(logits, -torch.inf).scatter_(2, argmax[..., None], 0.0)
    drafts = argmax[:, :3].clone()
    wrong_at = torch.arange(64) % 4  # 3 = no mismatch
    for r in range(64):
        if wrong_at[r] < 3:
            drafts[r, wrong_at[r]] = (drafts[r, wrong_at[r]] + 1) % 30
    seeds, positions = torch.arange(64), torch.arange(4).expand(64, 4) + 10
    for probs in (None, torch.softmax(torch.randn(64, 3, 30), -1)):
        res = rejection_sample(target, drafts, probs, seeds, positions, torch.full((64,), 3))
        assert torch.equal(res.num_accepted, wrong_at)
        for r in range(64):
            n = wrong_at[r].item()
            assert res.output_tokens[r, : n + 1].tolist() == argmax[r, : n + 1].tolist()
            assert torch.all(res.output_tokens[r, n + 1 :] == -1)


def test_greedy_verify_matches_rejection_sampling_on_one_hot_targets_with_and_without_drafts():
    """greedy_verify (the all-greedy fast path, with its shortcut for a step without drafts) gives what rejection
    sampling gives on the same argmax targets made one-hot, at k = 0 and k = 3."""
    g = torch.Generator().manual_seed(12)
    for k in (0, 3):
        argmax = torch.randint(0, 30, (16, k + 1), generator=g)
        drafts = argmax[:, :k].clone()
        drafts[::3, : min(k, 1)] = (drafts[::3, : min(k, 1)] + 1) % 30  # a wrong first draft in every third row
        num_drafts = torch.arange(16) % (k + 1)
        target = torch.full((16, k + 1, 30), -torch.inf).scatter_(2, argmax[..., None], 0.0)
        want = rejection_sample(target, drafts, None, torch.arange(16), torch.arange(k + 1).expand(16, k + 1),
                                num_drafts)
        got = greedy_verify(argmax, drafts, num_drafts)
        assert torch.equal(got.output_tokens, want.output_tokens) and torch.equal(got.num_accepted, want.num_accepted)


def _contextual_tables(seed: int, vocab: int, k: int, sharp: float):
    """p(. | prefix) for prefixes of length 0..k as tables [V]*L + [V]; same shape for q."""
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(sharp * torch.randn(*([vocab] * (length + 1)), generator=g), -1) for length in range(k + 1)]


def _lookup(tables, prefix: torch.Tensor) -> torch.Tensor:
    """[R, V]: the distribution after each row's prefix [R, L]."""
    if prefix.shape[1] == 0:
        return tables[0].expand(prefix.shape[0], -1)
    return tables[prefix.shape[1]][tuple(prefix.T)]


def test_three_drafts_joint_distribution_equals_sequential_sampling():
    # The target's distribution at each verify position depends on the drafted prefix, as in a
    # real model. Emitted tokens, completed to 3 tokens by plain sampling from p, must follow
    # p(t0) p(t1 | t0) p(t2 | t0 t1) jointly.
    vocab, k = 4, 3
    p_tab = _contextual_tables(20, vocab, k, 1.5)
    q_tab = _contextual_tables(21, vocab, k, 1.5)
    for t in range(k + 1):  # drafts close to the target so that all acceptance counts occur
        q_tab[t] = 0.5 * q_tab[t] + 0.5 * p_tab[t]
    g = torch.Generator().manual_seed(22)
    drafts = torch.empty(R, 0, dtype=torch.int64)
    draft_probs = []
    for _ in range(k):
        q = _lookup(q_tab, drafts)
        draft_probs.append(q)
        drafts = torch.cat([drafts, torch.multinomial(q, 1, generator=g)], 1)
    target = torch.stack([_lookup(p_tab, drafts[:, :i]).log() for i in range(k + 1)], 1)
    seeds = torch.arange(R) + 1000
    positions = torch.arange(k + 1).expand(R, k + 1) + 57
    res = rejection_sample(target, drafts, torch.stack(draft_probs, 1), seeds, positions, torch.full((R,), k))
    counts = torch.bincount(res.num_accepted, minlength=k + 1)
    assert torch.all(counts > 1000), counts
    seq = res.output_tokens[:, :3].clone()
    for i in range(3):  # complete with plain sampling where fewer than 3 tokens were emitted
        todo = seq[:, i] == -1
        if todo.any():
            seq[todo, i] = torch.multinomial(_lookup(p_tab, seq[todo, :i]), 1, generator=g).squeeze(1)
    cells = seq[:, 0] * vocab * vocab + seq[:, 1] * vocab + seq[:, 2]
    want = np.array([
        (p_tab[0][a] * p_tab[1][a, b] * p_tab[2][a, b, c]).item()
        for a, b, c in itertools.product(range(vocab), repeat=3)
    ])
    assert chi2_pvalue(cells, want) > ALPHA


def test_fewer_real_drafts_equals_shorter_call():
    rows, k = 300, 3
    g = torch.Generator().manual_seed(30)
    target = torch.log_softmax(torch.randn(rows, k + 1, V, generator=g), -1)
    probs = torch.softmax(torch.randn(rows, k, V, generator=g), -1)
    drafts = torch.multinomial(probs.reshape(-1, V), 1, generator=g).view(rows, k)
    seeds, positions = torch.arange(rows), torch.arange(k + 1).expand(rows, k + 1) + 5
    num_drafts = torch.arange(rows) % (k + 1)
    for q in (probs, None):
        res = rejection_sample(target, drafts, q, seeds, positions, num_drafts)
        for d in range(k + 1):
            rows_d = num_drafts == d
            short = rejection_sample(
                target[rows_d, : d + 1], drafts[rows_d, :d], None if q is None else q[rows_d, :d],
                seeds[rows_d], positions[rows_d, : d + 1], torch.full((int(rows_d.sum()),), d),
            )
            assert torch.all(res.num_accepted[rows_d] <= d)
            assert torch.equal(res.num_accepted[rows_d], short.num_accepted)
            assert torch.equal(res.output_tokens[rows_d, : d + 1], short.output_tokens)
            assert torch.all(res.output_tokens[rows_d, d + 1 :] == -1)


# ---------------------------------------------------------------------------- shared noise


def _plain_samples(logits: torch.Tensor, params, seeds, positions):
    """[R, k+1] tokens Sampler.sample gives at each (seed, position), one call per position."""
    sampler = Sampler()
    cols = []
    for i in range(logits.shape[1]):
        batch = SamplingBatch.from_params(params, seeds.tolist(), positions[:, i].tolist(), "cpu")
        cols.append(sampler.sample(logits[:, i], batch).token_ids)
    return torch.stack(cols, 1)


def test_shared_noise_verify_is_token_identical_to_plain_sampling():
    rows, k, vocab = 256, 4, 500
    g = torch.Generator().manual_seed(40)
    logits = torch.randn(rows, k + 1, vocab, generator=g) * 2
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=tk)
        for t, p, tk in itertools.product([0.0, 0.5, 1.0, 1.5], [1.0, 0.8], [0, 20])
    ] * (rows // 16)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    positions = torch.arange(k + 1).expand(rows, k + 1) + torch.randint(0, 1000, (rows, 1), generator=g)
    plain = _plain_samples(logits, params, seeds, positions)

    # target logprobs as the runner computes them: one processed_logprobs call over R*(k+1) rows
    flat_params = [p for p in params for _ in range(k + 1)]
    batch = SamplingBatch.from_params(flat_params, seeds.repeat_interleave(k + 1).tolist(), positions.reshape(-1).tolist(), "cpu")
    target = Sampler().processed_logprobs(logits.reshape(-1, vocab), batch).view(rows, k + 1, vocab)

    # drafts agree with the target's samples for a random prefix, then differ
    agree = torch.randint(0, k + 1, (rows,), generator=g)
    drafts = plain[:, :k].clone()
    cols = torch.arange(k)
    drafts = torch.where(cols[None] < agree[:, None], drafts, (drafts + 1) % vocab)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=g)
    res = shared_noise_verify(target, drafts, seeds, positions, num_drafts)
    want_accepted = torch.minimum(agree, num_drafts)
    assert torch.equal(res.num_accepted, want_accepted)
    emitted = torch.arange(k + 1)[None] <= want_accepted[:, None]
    assert torch.equal(res.output_tokens[emitted], plain[emitted])
    assert torch.all(res.output_tokens[~emitted] == -1)
    # rejection sampling's bonus token is the same plain sample
    full = rejection_sample(target, plain[:, :k], None, seeds, positions, torch.full((rows,), k))
    all_in = full.num_accepted == k
    assert all_in.sum() > 16  # at least the greedy rows
    assert torch.equal(full.output_tokens[all_in], plain[all_in])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verification_same_on_cuda():
    rows, k = 512, 3
    g = torch.Generator().manual_seed(50)
    target = torch.log_softmax(torch.randn(rows, k + 1, 300, generator=g), -1)
    probs = torch.softmax(torch.randn(rows, k, 300, generator=g), -1)
    drafts = torch.multinomial(probs.reshape(-1, 300), 1, generator=g).view(rows, k)
    args = (torch.arange(rows), torch.arange(k + 1).expand(rows, k + 1), torch.arange(rows) % 4)
    cuda_args = tuple(a.cuda() for a in args)
    for q in (probs, None):
        cpu = rejection_sample(target, drafts, q, *args)
        gpu = rejection_sample(target.cuda(), drafts.cuda(), None if q is None else q.cuda(), *cuda_args)
        assert torch.equal(cpu.output_tokens, gpu.output_tokens.cpu())
    cpu = shared_noise_verify(target, drafts, *args)
    gpu = shared_noise_verify(target.cuda(), drafts.cuda(), *cuda_args)
    assert torch.equal(cpu.output_tokens, gpu.output_tokens.cpu())
