"""The seeded sampler: processed target distribution + Gumbel-max with (seed, position) noise.

One code path serves seeded and unseeded requests: the engine gives every request a seed, and
the noise for the token at sequence index ``position`` is ``gumbel(seed, position)`` (see
``noise.py``). A request therefore samples the same tokens alone or in any batch, and the
shared-noise verifier (``rejection.shared_noise_verify``) reproduces them exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.core.host_ints import host_ints
from eyas.sampling.params import SamplingParams
from eyas.sampling.row_ops import (
    EXP_FLOOR,
    argmax,
    gumbel_argmax,
    log_normaliser,
    log_softmax_above_,
    nucleus_thresholds,
    top_values,
)


@dataclass
class SamplingBatch:
    """One row per logits row; built by the runner once per step."""

    temperature: Tensor  # [N] float32, 0 = greedy
    top_k: Tensor  # [N] int64, 0 = off
    top_p: Tensor  # [N] float32, 1 = off
    min_p: Tensor  # [N] float32, 0 = off
    seeds: Tensor  # [N] int64
    positions: Tensor  # [N] int64: sequence index of the token being sampled
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int | None  # None = no logprobs; 0 = only the sampled token's
    max_top_k: int = 0  # max(top_k) when every row has a top-k (sort only that many), else 0

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        device: torch.device | str,
    ) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_k = [0 if g or p.top_k == -1 else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def f32(x: list) -> Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        def i64(x: list) -> Tensor:
            return host_ints(x).to(device)

        return cls(
            temperature=f32([0.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_k=i64(top_k),
            top_p=f32(top_p),
            min_p=f32(min_p),
            seeds=i64(seeds),
            positions=i64(positions),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            max_num_logprobs=max(asked) if asked else None,
            max_top_k=max(top_k) if all(k > 0 for k in top_k) else 0,
        )


@dataclass
class LogprobsTensors:
    """Logprobs of the RAW model distribution (log_softmax of unprocessed logits)."""

    sampled_logprobs: Tensor  # [N] float32: logprob of the sampled token
    top_token_ids: Tensor  # [N, n] int64, best first
    top_logprobs: Tensor  # [N, n] float32


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] int64
    logprobs: LogprobsTensors | None


def probabilities(logprobs: Tensor) -> Tensor:
    """exp(logprobs), with what lies below e^EXP_FLOOR (1.6e-38: float32's subnormals) as 0."""
    return logprobs.clamp(min=EXP_FLOOR).exp_().masked_fill_(logprobs < EXP_FLOOR, 0.0)


def log_probabilities(probs: Tensor) -> Tensor:
    """log(probs), with 0 (and subnormals) as -inf: PyTorch's CPU log of 0 takes a slow path too."""
    tiny = math.exp(EXP_FLOOR)
    return probs.clamp(min=tiny).log_().masked_fill_(probs < tiny, -math.inf)


NUCLEUS_WIDTHS = (64, 1024, 8192)  # the best values sorted for top-p, widest last, before the whole vocabulary


def _thresholds(x: Tensor, k: Tensor, top_p: Tensor, width: int, any_top_k: bool) -> tuple[Tensor, Tensor]:
    """Each row's smallest kept value after top-k then top-p, from its best ``width`` values.

    x [N, V] scaled logits, k [N] (V = top-k off), top_p [N] (1 = off), any_top_k: some row has a top-k
    (else the mass needs no masking of x). Top-k keeps values >= the
    k-th largest; top-p keeps each survivor whose strictly-better mass is < top_p. Returns the
    threshold [N, 1] and settled [N]: whether the best ``width`` values decide it, which holds when
    the row's k-th value is among them (or top-k is off) and, with top-p, their mass reaches top_p
    (every later value then has at least that much mass before it, so none is kept).
    Example: width 2, top-p 0.9: probs [.7, .25, .04, .01] settle (.95 >= .9, threshold .25's
    logit); probs [.5, .3, .15, .05] do not (.8 < .9).
    """
    native = nucleus_thresholds(x, k, top_p, width)  # the same, in one C call on a CPU
    if native is not None:
        return native
    vocab = x.shape[-1]
    vals = top_values(x, width)  # [N, width], descending
    kth = vals.gather(1, (k - 1).clamp(max=width - 1)[:, None])  # [N, 1]
    kth = torch.where((k == vocab)[:, None] & (width < vocab), -math.inf, kth)
    settled = (k <= width) | (k == vocab)  # [N]
    vals = vals.masked_fill(vals < kth, -math.inf)
    log_z = log_normaliser(x, kth if any_top_k else None)  # [N, 1]; without top-k, kth is -inf (or the minimum)
    mass = torch.cumsum(probabilities(vals - log_z), dim=-1)  # [N, width]
    mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # exclusive cumsum
    num_keep = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)  # >= 1
    t_p = torch.where(top_p[:, None] < 1, vals.gather(1, num_keep - 1), -math.inf)  # [N, 1]
    settled &= (top_p >= 1) | (mass[:, -1] >= top_p)
    return torch.maximum(kth, t_p), settled


class Sampler:
    def processed_logprobs(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """[N, V] float32 log-probabilities of the exact distribution that `sample` draws from.

        Order (vLLM v0's; vLLM v1 applies min-p before top-k/top-p):
          1. divide logits by temperature;
          2. top-k: keep logits >= the k-th largest (ties at the boundary are all kept);
          3. top-p: sort the survivors descending, keep each token whose strictly-better mass
             is < top_p (the smallest prefix reaching top_p; at least one token; ties with the
             last kept value are kept);
          4. min-p: drop tokens whose probability (after 2-3) is < min_p * the largest one;
          5. log_softmax. Masked tokens get -inf.
        Greedy rows (temperature 0) are one-hot at argmax(logits): 0 there, -inf elsewhere.

        Example: logits [2, 1, 0, -1], T=1, top_k=3, top_p=0.9. Top-k drops -1; the survivors'
        probs are [.665, .245, .090], whose strictly-better masses are [0, .665, .910], so top-p
        keeps the first two: logprobs [-0.313, -1.313, -inf, -inf].
        """
        logits = logits.to(torch.float32)  # [N, V]
        greedy = batch.temperature == 0  # [N]
        x = logits / torch.where(greedy, 1.0, batch.temperature)[:, None]  # a new tensor, changed in place below
        if batch.any_top_k or batch.any_top_p:
            log_softmax_above_(x, self._top_k_top_p(x, batch))
        else:
            log_softmax_above_(x, torch.full((x.shape[0], 1), -math.inf, device=x.device))
        if batch.any_min_p:
            # prob < min_p * max_prob  <=>  logprob < log(min_p) + max_logprob (min_p=0 -> -inf).
            log_softmax_above_(x, x.amax(dim=-1, keepdim=True) + torch.log(batch.min_p)[:, None])
        if not batch.any_greedy:
            return x
        one_hot = torch.full_like(x, -math.inf).scatter_(1, argmax(logits)[:, None], 0.0)
        return torch.where(greedy[:, None], one_hot, x)

    @staticmethod
    def _top_k_top_p(x: Tensor, batch: SamplingBatch) -> Tensor:
        """[N, 1] each row's threshold (``_thresholds``) of [N, V] scaled logits: the smallest value kept.

        Thresholds (not sort positions) decide, so tokens tied at a boundary are all kept. Only the
        best values are sorted: the best max_top_k when every row has a top-k; else the best
        NUCLEUS_WIDTHS[0], and a row whose top-k or nucleus reaches past them (a flat distribution)
        goes on to the next width, the last being the whole vocabulary. A full sort of SmolLM2's
        49,152 logits took 5 ms a row on a CPU, most of a decode step, and a speculative step pays it
        for every row it verifies; the best 1,024 take 0.16 ms, the best 64 (``top_values``, which
        settle a row at a low temperature) a tenth of that.
        """
        vocab = x.shape[-1]
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)  # [N]
        widths = ([min(batch.max_top_k, vocab)] if batch.max_top_k > 0
                  else [w for w in NUCLEUS_WIDTHS if w < vocab] + [vocab])
        threshold, settled = _thresholds(x, k, batch.top_p, widths[0], batch.any_top_k)  # [N, 1], [N]
        rows = torch.arange(x.shape[0], device=x.device)
        for width in widths[1:]:  # the last, the whole vocabulary, settles whatever is left
            rows = rows[~settled]  # the rows the narrower width did not settle
            if not len(rows):
                break
            threshold[rows], settled = _thresholds(x[rows], k[rows], batch.top_p[rows], width, batch.any_top_k)
        return threshold

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Greedy rows: argmax. Others: argmax(processed_logprobs + gumbel(seed, position))."""
        if batch.all_greedy:
            token_ids = argmax(logits)
        else:
            logprobs = self.processed_logprobs(logits, batch)
            token_ids = gumbel_argmax(logprobs, batch.seeds, batch.positions)
        return SamplerOutput(token_ids, raw_logprobs(logits, token_ids, batch.max_num_logprobs))


def raw_logprobs(logits: Tensor, token_ids: Tensor, n: int | None) -> LogprobsTensors | None:
    """Logprobs of the unprocessed distribution: each row's token [N] and its top-n ([N, n])."""
    if n is None:
        return None
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    top_logprobs, top_ids = torch.topk(raw, n, dim=-1)
    sampled = raw.gather(1, token_ids[:, None]).squeeze(1)
    return LogprobsTensors(sampled, top_ids, top_logprobs)
