"""What a drafter is trained to match: the target's next-token distribution, and the unrolled loss.

Index conventions over a sequence ``x_0 .. x_{T-1}`` with target states ``h_t``:

* ``p_t = softmax(head(norm(h_t)))`` is the target's distribution of ``x_{t+1}``; restricted to the
  training vocabulary (EAGLE-3's draft vocabulary) and renormalised.
* ``p_t`` counts (is *valid*) where ``x_{t+1}`` exists and is an assistant token (the loss mask)
  and the target's argmax over the WHOLE vocabulary lies in the training vocabulary.
* Unroll step ``i`` at index ``t`` is fed token ``x_{t+1+i}`` and predicts ``x_{t+2+i}``: it is scored
  against ``p_{t+1+i}`` where that is valid, with the soft cross-entropy ``-sum p log q``
  (``"soft"``) or ``-log q(x_{t+2+i})`` (``"hard"``, where ``x_{t+2+i}`` is an assistant token in the
  training vocabulary). Step ``i``'s loss is the mean over its scored positions, weighted
  ``decay ** i`` by the trainer.

Example, T = 5, step 1: index 0 is fed x2 and scored against p2 (the distribution of x3); index 3
would be scored against p4, the distribution of x5, which does not exist: not scored.

Only the scored positions go through the drafter's head, and the target's distribution is kept
for the valid positions only (``[num_valid, Vd]``), so padding and prompt tokens cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("soft", "hard")


@dataclass
class Targets:
    probs: torch.Tensor  # [num_valid, Vd] float32: p_t over the training vocabulary, valid positions only
    row: torch.Tensor  # [B, T] int64: the row of probs holding p_t, -1 where p_t is not valid
    argmax: torch.Tensor  # [B, T] int64: argmax of p_t as a training-vocabulary id (-1 where not valid)
    labels: torch.Tensor  # [B, T] int64: x_{t+1} as a training-vocabulary id, -1 outside it / the mask / the end


class TargetHead:
    """The frozen target's final norm and head, split once by the training vocabulary: its rows
    ``[Vd, Ht]``, and the rows outside it ``[V - Vd, Ht]`` kept for the argmax test (in bfloat16
    where the CPU or GPU multiplies it natively: a near-tie may then fall either way)."""

    def __init__(self, norm: torch.nn.Module, head_weight: torch.Tensor, vocab_ids: torch.Tensor | None):
        """head_weight [V, Ht]; vocab_ids [Vd] ascending target ids of the training vocabulary (None: all)."""
        vocab, device = head_weight.shape[0], head_weight.device
        self.norm = norm
        self.to_train = torch.arange(vocab, device=device)  # [V] target id -> training id, -1 outside
        self.train_weight = head_weight  # [Vd, Ht]
        self.rest_weight = None  # [V - Vd, Ht]
        if vocab_ids is not None:
            self.to_train = torch.full((vocab,), -1, dtype=torch.int64, device=device).index_copy_(
                0, vocab_ids, torch.arange(len(vocab_ids), device=device))
            self.train_weight = head_weight[vocab_ids]
            outside = self.to_train < 0
            if outside.any():
                self.rest_weight = head_weight[outside].to(torch.bfloat16 if native_bf16(device) else head_weight.dtype)

    @torch.no_grad()
    def distribution(self, last: torch.Tensor, token_ids: torch.Tensor, loss_mask: torch.Tensor,
                     chunk: int = 2048) -> Targets:
        """last [B, T, Ht] (layer N, before the final norm), token_ids/loss_mask [B, T]."""
        batch, seq, _ = last.shape
        device = last.device
        candidate = torch.zeros_like(loss_mask)
        candidate[:, :-1] = loss_mask[:, 1:]
        flat = candidate.reshape(-1).nonzero().squeeze(1)  # flat (b * T + t) of candidate positions
        states = self.norm(last.reshape(batch * seq, -1)[flat])  # [n, Ht]
        rest = self.rest_weight
        kept, probs = [], []
        for i in range(0, len(flat), chunk):
            logits = F.linear(states[i:i + chunk], self.train_weight).float()  # [c, Vd]
            if rest is not None:  # the whole-vocabulary argmax lies inside: no row outside beats the best inside
                keep = logits.amax(-1) >= F.linear(states[i:i + chunk].to(rest.dtype), rest).amax(-1).float()
                logits = logits[keep]
                kept.append(keep)
            probs.append(logits.softmax(-1))
        if kept:
            flat = flat[torch.cat(kept)]
        probs = torch.cat(probs) if probs else states.new_zeros(0, len(self.train_weight))
        row = torch.full((batch * seq,), -1, dtype=torch.int64, device=device)
        row[flat] = torch.arange(len(flat), device=device)
        argmax = torch.full((batch * seq,), -1, dtype=torch.int64, device=device)
        argmax[flat] = probs.argmax(-1) if len(flat) else flat
        labels = torch.full_like(token_ids, -1)
        labels[:, :-1] = torch.where(loss_mask[:, 1:], self.to_train[token_ids[:, 1:]], -1)
        return Targets(probs, row.view(batch, seq), argmax.view(batch, seq), labels)


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass
class StepStats:
    """Sums over one unroll step's scored positions (sums, so data-parallel ranks can add them)."""

    loss_sum: torch.Tensor  # scalar, with grad
    count: torch.Tensor  # scalar: positions scored
    agree: torch.Tensor  # scalar: positions where the drafter's argmax equals the target's


def scored_positions(step: int, targets: Targets, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) of the positions unroll step ``step`` is scored at."""
    shift = 1 + step
    later = targets.row[:, shift:] if loss == "soft" else targets.labels[:, shift:]  # [B, T - shift]
    return (later >= 0).nonzero(as_tuple=True)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``-sum_v p_v log softmax(z)_v`` per row and ``argmax z``, over ``CHUNK`` rows at a time.

    ``logits`` [n, Vd] (any float dtype, kept as given); the target of row i is ``probs[rows[i]]``
    (soft) or one-hot ``labels[i]`` (hard, ``probs`` None). The float32 work (log-sum-exp, the
    dot with p, and the backward's ``softmax(z) - p``) runs on one chunk while it is in cache, so
    no float32 ``[n, Vd]`` copy, gathered ``p`` or product is ever made: at 4 unroll steps over
    8,192 draft tokens that was about 40% of a training step on a CPU. Saved for backward: the
    logits as given and the ``[n]`` log-sum-exps.
    """

    CHUNK = 32  # rows: a float32 chunk of 8,192 logits is 1 MiB, inside a core's L2
    GPU_CHUNK = 4096  # on a GPU, rows per launch: a loop of 32-row chunks is bound by kernel launches

    @staticmethod
    def rows_per_chunk(logits: torch.Tensor) -> int:
        return _ChunkedCrossEntropy.CHUNK if logits.device.type == "cpu" else _ChunkedCrossEntropy.GPU_CHUNK

    @staticmethod
    def forward(ctx, logits, probs, rows, labels):
        n = logits.shape[0]
        chunk = _ChunkedCrossEntropy.rows_per_chunk(logits)
        ce = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(ce)
        argmax = torch.empty(n, dtype=torch.int64, device=logits.device)
        for i in range(0, n, chunk):
            z = logits[i:i + chunk].float()  # [c, Vd]
            lse[i:i + len(z)] = torch.logsumexp(z, dim=-1)
            if probs is not None:
                dot = torch.linalg.vecdot(probs[rows[i:i + len(z)]], z)
            else:
                dot = z.gather(-1, labels[i:i + len(z)].unsqueeze(-1)).squeeze(-1)
            ce[i:i + len(z)] = lse[i:i + len(z)] - dot
            argmax[i:i + len(z)] = z.argmax(-1)
        ctx.save_for_backward(logits, probs, rows, labels, lse)
        ctx.mark_non_differentiable(argmax)
        return ce, argmax

    @staticmethod
    def backward(ctx, grad_ce, grad_argmax):
        logits, probs, rows, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        chunk = _ChunkedCrossEntropy.rows_per_chunk(logits)
        for i in range(0, len(logits), chunk):
            z = logits[i:i + chunk].float()
            g = torch.exp(z - lse[i:i + len(z)].unsqueeze(-1))  # softmax(z)
            if probs is not None:
                g -= probs[rows[i:i + len(z)]]
            else:
                g.scatter_add_(-1, labels[i:i + len(z)].unsqueeze(-1), g.new_full((len(z), 1), -1.0))
            grad[i:i + len(z)] = g * grad_ce[i:i + len(z)].unsqueeze(-1)
        return grad, None, None, None


def step_stats(step: int, normed: torch.Tensor, head, targets: Targets, loss: str = "soft") -> StepStats:
    """normed [B, T, H]: unroll step ``step``'s normed output; ``head(step, x [n, H]) -> [n, Vd]`` logits."""
    b, t = scored_positions(step, targets, loss)
    return scored_stats(step, normed[b, t], b, t + 1 + step, head, targets, loss)


def scored_stats(step: int, rows: torch.Tensor, b: torch.Tensor, later: torch.Tensor, head, targets: Targets,
                 loss: str = "soft") -> StepStats:
    """rows [n, H]: normed outputs scored against ``p_{later}`` of sequence ``b`` (each [n]), all valid."""
    if len(b) == 0:
        zero = rows.sum() * 0
        return StepStats(zero, zero.detach(), zero.detach())
    logits = head(step, rows)  # [n, Vd]
    if loss == "soft":
        ce, argmax = _ChunkedCrossEntropy.apply(logits, targets.probs, targets.row[b, later], None)
    else:
        ce, argmax = _ChunkedCrossEntropy.apply(logits, None, None, targets.labels[b, later])
    agree = (argmax == targets.argmax[b, later]).sum()
    return StepStats(ce.sum(), torch.tensor(float(len(b)), device=ce.device), agree.to(ce.dtype))
