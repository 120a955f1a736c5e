"""Lossless verification of k chain-drafted tokens: rejection sampling and shared-noise matching.

Both take the target's processed log-probabilities at the k+1 verify positions (the runner
computes them with ``Sampler.processed_logprobs``) and return, per request, the accepted drafts
followed by one token sampled by the target (a recovered token at the first rejection, or the
bonus token when every real draft was accepted). Everything is vectorised over requests and
draft positions; the only randomness is ``noise.py``'s, keyed by (seed, position, stream):
stream 0 = the sampler's Gumbel noise, 1 = acceptance uniforms, 2 = recovered-token noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.sampling.noise import uniform
from eyas.sampling.row_ops import gumbel_argmax
from eyas.sampling.sampler import log_probabilities, probabilities


@dataclass
class VerifyResult:
    output_tokens: Tensor  # [R, k+1] int64: num_accepted[r] + 1 tokens, then -1 padding
    num_accepted: Tensor  # [R] int64: accepted drafts (tokens emitted = num_accepted + 1)


def _emit(prefix: Tensor, num_accepted: Tensor, last: Tensor) -> Tensor:
    """[R, k+1]: the first num_accepted[r] entries of prefix [R, k], then last[r], then -1."""
    padded = torch.nn.functional.pad(prefix, (0, 1), value=-1)  # [R, k+1]
    cols = torch.arange(padded.shape[1], device=padded.device)
    out = torch.where(cols[None, :] < num_accepted[:, None], padded, -1)
    return out.scatter_(1, num_accepted[:, None], last[:, None])


def _count_accepted(accepted: Tensor, num_drafts: Tensor) -> Tensor:
    """[R] int64: length of the all-True prefix of accepted [R, k] within the real drafts."""
    k = accepted.shape[1]
    real = torch.arange(k, device=accepted.device)[None, :] < num_drafts[:, None]
    return (accepted & real).to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_sample(
    target_logprobs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    seeds: Tensor,
    positions: Tensor,
    num_drafts: Tensor,
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023): the output follows the target exactly.

    target_logprobs [R, k+1, V] processed target logprobs at the k+1 verify positions;
    draft_tokens [R, k] int64; draft_probs [R, k, V] or None (drafts count as one-hot);
    seeds [R] int64; positions [R, k+1] int64 (sequence index of each verified token);
    num_drafts [R] int64 (only the first num_drafts[r] drafts of row r are real).

    Draft x_i is accepted when u_i * q_i(x_i) < p_i(x_i), u_i = uniform(seed, positions[:, i],
    stream 1) (i.e. with probability min(1, p/q)). At the first rejection n the target samples a
    recovered token from normalize(max(p_n - q_n, 0)) (Gumbel-max, stream 2); when all real
    drafts are accepted (n = num_drafts) it samples the bonus token from p_n with the stream-0
    noise, exactly the token plain sampling would give at that position. A greedy target
    (one-hot p) reduces to "accept while the draft equals the argmax".

    Example (k=2, V=3, one-hot drafts [0, 2]): p_0 = [.5, .3, .2], p_1 = [.1, .6, .3].
    Position 0: accept 0 if u_0 < .5 -- say u_0 = .3, accepted. Position 1: accept 2 if
    u_1 < .3 -- say u_1 = .8, rejected; recover from max(p_1 - onehot(2), 0) = [.1, .6, 0]
    normalised to [1/7, 6/7, 0] -- say 1. Result: output_tokens [[0, 1, -1]], num_accepted [1].
    """
    num_rows, k_plus_1, vocab = target_logprobs.shape
    k = k_plus_1 - 1
    assert draft_tokens.shape == (num_rows, k), (draft_tokens.shape, target_logprobs.shape)
    device = target_logprobs.device
    rows = torch.arange(num_rows, device=device)

    p_draft = probabilities(target_logprobs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1))  # [R, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1).to(p_draft.dtype)
    u = uniform(seeds.repeat_interleave(k), positions[:, :k].reshape(-1), 1, 1).view(num_rows, k)
    num_accepted = _count_accepted(u * q_draft < p_draft, num_drafts)  # [R]

    # The target's own token at position n = num_accepted: recovered (n < num_drafts) or bonus.
    n = num_accepted
    bonus = n >= num_drafts  # [R]
    logp_n = target_logprobs[rows, n].to(torch.float32)  # [R, V]
    if k > 0:
        j = n.clamp(max=k - 1)
        if draft_probs is None:
            q_n = torch.zeros_like(logp_n).scatter_(1, draft_tokens[rows, j][:, None], 1.0)
        else:
            q_n = draft_probs[rows, j].to(torch.float32)
        p_n = probabilities(logp_n)
        residual = (p_n - q_n).clamp_(min=0)  # [R, V]
        # p == q up to rounding leaves no residual mass; then any rejection was rounding noise.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_n)
        scores = torch.where(bonus[:, None], logp_n, log_probabilities(residual))
    else:
        scores = logp_n
    stream = torch.where(bonus, 0, 2)
    last = gumbel_argmax(scores, seeds, positions[rows, n], stream)  # [R]
    return VerifyResult(_emit(draft_tokens, num_accepted, last), num_accepted)


def shared_noise_verify(
    target_logprobs: Tensor,
    draft_tokens: Tensor,
    seeds: Tensor,
    positions: Tensor,
    num_drafts: Tensor,
) -> VerifyResult:
    """Accept drafts while they equal the target's own seeded sample; token-identical output.

    The target's sample at verify position i is ``gumbel_argmax(target_logprobs[:, i], seeds,
    positions[:, i])`` -- the very call ``Sampler.sample`` makes for that (seed, position) -- so
    the emitted tokens (target samples up to and including the first mismatch, or the bonus
    after num_drafts matches) are those the request would produce without speculation. Shapes
    as in ``rejection_sample``. Lossless for any drafter; the acceptance rate is high when the
    drafter samples with the same (seed, position) noise.

    Example (k=3): target samples [5, 9, 4, 7], drafts [5, 9, 1] -> drafts 0 and 1 match,
    draft 2 does not: output_tokens [[5, 9, 4, -1]], num_accepted [2]. With drafts [5, 9, 4]
    all match and the bonus 7 follows: [[5, 9, 4, 7]], num_accepted [3].
    """
    num_rows, k_plus_1, vocab = target_logprobs.shape
    samples = gumbel_argmax(
        target_logprobs.reshape(num_rows * k_plus_1, vocab),
        seeds.repeat_interleave(k_plus_1),
        positions.reshape(-1),
    ).view(num_rows, k_plus_1)  # [R, k+1]
    num_accepted = _count_accepted(draft_tokens == samples[:, :-1], num_drafts)
    last = samples[torch.arange(num_rows, device=samples.device), num_accepted]  # [R]
    return VerifyResult(_emit(samples[:, :-1], num_accepted, last), num_accepted)


def greedy_verify(target: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> VerifyResult:
    """Exact-match fast path for an all-greedy batch: no softmax, no noise.

    target [R, k+1]: the target's argmax tokens; accept drafts while they equal them. Example:
    target [5, 9, 4, 7], drafts [5, 9, 1] -> [[5, 9, 4, -1]], num_accepted [2]. Without drafts (k = 0, a plain
    decode step) the tokens are the target's as they are.
    """
    if target.shape[1] == 1:
        return VerifyResult(target, torch.zeros(target.shape[0], dtype=torch.int64, device=target.device))
    num_accepted = _count_accepted(draft_tokens == target[:, :-1], num_drafts)
    last = target.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(_emit(target[:, :-1], num_accepted, last), num_accepted)
