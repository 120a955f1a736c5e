"""Training a parallel (P-EAGLE) drafter: which rows each depth trains, the training mask, the forward.

A parallel drafter of K depths drafts K tokens from one pass (``eyas.model.drafters.eagle3``): depth 0
is the EAGLE-3 step over the target's aux states at anchor ``a`` (fed token ``x_{a+1}``), and depth
``d >= 1`` is a row at position ``a + d`` fed the mask token and ``mask_hidden``. Row ``(d, a)``
predicts ``x_{a+2+d}``: it is scored against ``p_{a+1+d}``, as unroll step d at index a is in
``eyas.train.objective``.

Training every depth at every anchor costs K x length. Conditional drop-token sampling (the recipe of
speculators' P-EAGLE trainer, "COD"): depth 0 keeps every position; depth d keeps ``n_d =
max(ceil(T * keep^d), ceil(T * floor))`` anchors, the first n_d of one random order per sequence, so
depth d's anchors are a subset of depth d-1's (a depth-d row attends to the rows of depths 1..d-1 at
its anchor, which must exist). Anchors whose depth-1 row is scored come first in the order. With
keep 0.5, floor 0.05 and K = 8, a batch runs 2.2 x length rows instead of 8 x length.

Training mask, rows named (depth, anchor):

* (0, t) sees (0, s) for s <= t (causal over the sequence);
* (d, a) sees (0, s) for s <= a, and (j, a) for 1 <= j <= d.

Worked example: T = 4, K = 3, order [2, 0, 3, 1], n = [4, 2, 1]: depth 1 at anchors 2 and 0, depth
2 at anchor 2. The dense mask over the rows (0,0) (0,1) (0,2) (0,3) | (1,2) (1,0) | (2,2)::

    (0,0): 1 0 0 0 | 0 0 | 0
    (0,1): 1 1 0 0 | 0 0 | 0
    (0,2): 1 1 1 0 | 0 0 | 0
    (0,3): 1 1 1 1 | 0 0 | 0
    (1,2): 1 1 1 0 | 1 0 | 0         at position 3, scored against p_4 (none: T = 4, not scored)
    (1,0): 1 0 0 0 | 0 1 | 0         at position 1, scored against p_2
    (2,2): 1 1 1 0 | 1 0 | 1         at position 4

At inference (``eyas.spec_decode.speculator``) the rows of depth d >= 1 are the mask rows after the row that
gave the first draft: they see the drafter's cache up to the anchor and the mask rows before them, as
here. The depth-0 block runs through the fused causal kernel; the rows of depth d are ``n_d`` queries
against the ``T`` depth-0 keys (masked past their anchor) and their own d diagonal keys, so memory
grows as ``sum_d n_d * T`` scores per head, not ``(K * T)^2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from eyas.model.forward_context import ForwardContext, forward_context
from eyas.train.attention import ttt_attention
from eyas.train.objective import StepStats, Targets, scored_stats


def depth_counts(seq_len: int, depths: int, keep: float, floor: float) -> list[int]:
    """Rows per sequence at each depth: ``[T, n_1, .., n_{K-1}]``, non-increasing, each in [1, T]."""
    counts = [seq_len]
    for d in range(1, depths):
        counts.append(min(counts[-1], max(1, math.ceil(seq_len * keep ** d), math.ceil(seq_len * floor))))
    return counts


def plan_anchors(scored: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """scored [B, T] bool (depth 1's row at that anchor is scored) -> anchors [B, count] int64: a random order
    per sequence, scored anchors first; depth d trains at its first ``n_d``."""
    key = torch.rand(scored.shape, generator=generator, device=scored.device) + (~scored).float()  # [B, T]
    return key.argsort(dim=1)[:, :count]


def anchored_attention(q: torch.Tensor, base_k: torch.Tensor, base_v: torch.Tensor, anchors: torch.Tensor,
                       diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Attention of the rows of one depth d >= 1: q ``[B, n, Hq, D]`` at ``anchors`` [B, n]; base_k/base_v
    ``[B, T, Hkv, D]`` (depth 0's keys); diag_k/diag_v: per depth 1..d, ``[B, n, Hkv, D]``, the keys of the
    rows at the same anchors (the last: this depth's own). Returns ``[B, n, Hq, D]``."""
    heads, dim = q.shape[2], q.shape[3]
    group = heads // base_k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    qh = q.transpose(1, 2).to(wide)  # [B, Hq, n, D]
    kb = base_k.repeat_interleave(group, dim=2).transpose(1, 2).to(wide)  # [B, Hq, T, D]
    vb = base_v.repeat_interleave(group, dim=2).transpose(1, 2).to(wide)
    base = torch.matmul(qh, kb.transpose(-1, -2))  # [B, Hq, n, T]
    visible = torch.arange(base_k.shape[1], device=q.device) <= anchors[:, None, :, None]  # [B, 1, n, T]
    base = base.masked_fill(~visible, float("-inf"))
    keys = [k.repeat_interleave(group, dim=2).transpose(1, 2).to(wide) for k in diag_k]  # [B, Hq, n, D] each
    values = [v.repeat_interleave(group, dim=2).transpose(1, 2).to(wide) for v in diag_v]
    diag = torch.stack([(qh * k).sum(-1) for k in keys], dim=-1)  # [B, Hq, n, d]
    probs = (torch.cat([base, diag], dim=-1) / math.sqrt(dim)).softmax(-1)  # [B, Hq, n, T + d]
    out = torch.matmul(probs[..., :base.shape[-1]], vb)
    out = out + sum(probs[..., base.shape[-1] + j, None] * v for j, v in enumerate(values))
    return out.to(q.dtype).transpose(1, 2)


@dataclass
class DepthKeys:
    """One attention layer's keys across the depths of a training forward."""

    batch: int
    seq_len: int
    anchors: torch.Tensor | None = None  # [B, n] of the depth running now; None: depth 0
    base: tuple[torch.Tensor, torch.Tensor] | None = None  # depth 0's keys and values [B, T, Hkv, D]
    depths: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # depth 1.. [B, n_d, Hkv, D]


class ParallelTrainingAttention:
    """The backend of a parallel drafter's training forward (``kv_cache`` ignored)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, keys: DepthKeys) -> torch.Tensor:
        """q [rows, Hq, D], k/v [rows, Hkv, D], rows = B * T (depth 0) or B * n (depth d) -> [rows, Hq, D]."""
        rows = keys.seq_len if keys.anchors is None else keys.anchors.shape[1]
        q, k, v = (x.view(keys.batch, rows, *x.shape[1:]) for x in (q, k, v))
        if keys.anchors is None:
            keys.base = (k, v)
            out = ttt_attention(q, k, v, [], [])
        else:
            keys.depths.append((k, v))
            diag = [(dk[:, :rows], dv[:, :rows]) for dk, dv in keys.depths]  # the same anchors' rows
            out = anchored_attention(q, *keys.base, keys.anchors, [d[0] for d in diag], [d[1] for d in diag])
        return out.reshape(-1, *out.shape[2:])


def forward_depths(recipe, batch, anchors: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """The normed outputs of every depth: depth 0 ``[B, T, H]`` at every position, depth d ``[B, n_d, H]`` at
    ``anchors[:, :n_d]`` (positions anchor + d)."""
    drafter = recipe.drafter
    bsz, seq = batch.token_ids.shape
    keys = {}
    for group, layer in enumerate(drafter.attention_layers()):
        layer.kv_cache_group = group
        keys[group] = DepthKeys(bsz, seq)
    inputs0 = torch.nn.functional.pad(batch.token_ids, (0, 1))[:, 1:].reshape(-1)  # x_{t+1} at t, 0 past the end
    positions0 = torch.arange(seq, device=batch.token_ids.device).expand(bsz, seq)
    out = []
    with forward_context(ForwardContext(ParallelTrainingAttention(), keys)):
        normed, _ = drafter(0, inputs0, positions0.reshape(-1), recipe.first_hidden(batch))
        out.append(normed.view(bsz, seq, -1))
        for d in range(1, len(counts)):
            at = anchors[:, :counts[d]]  # [B, n_d]
            for layer_keys in keys.values():
                layer_keys.anchors = at
            input_ids, hidden = drafter.mask_inputs(at.numel(), at.device)
            normed, _ = drafter(0, input_ids, (at + d).reshape(-1), hidden)
            out.append(normed.view(bsz, counts[d], -1))
    return out


def _later(targets: Targets, loss: str) -> torch.Tensor:
    """[B, T] int64: the row of p_t in ``targets`` (soft) or the label of x_{t+1} (hard), -1 where not scored."""
    return targets.row if loss == "soft" else targets.labels


def depth_stats(recipe, batch, targets: Targets, depths: int, keep: float, floor: float, loss: str = "soft",
                generator: torch.Generator | None = None) -> list[StepStats]:
    """The sums of every depth's loss over its sampled rows (depth d at anchor a scored against p_{a+1+d})."""
    seq = batch.token_ids.shape[1]
    scored = _later(targets, loss)  # [B, T]
    counts = depth_counts(seq, depths, keep, floor)
    depth1 = torch.nn.functional.pad(scored[:, 2:] >= 0, (0, 2), value=False)  # [B, T] p_{a+2} scored
    anchors = plan_anchors(depth1, counts[1] if depths > 1 else 1, generator)
    normed = forward_depths(recipe, batch, anchors, counts)
    stats = []
    for d, out in enumerate(normed):
        at = torch.arange(seq, device=out.device).expand(out.shape[0], seq) if d == 0 else anchors[:, :counts[d]]
        later = at + 1 + d  # [B, n_d]
        ok = later < seq
        ok &= scored.gather(1, later.clamp(max=seq - 1)) >= 0
        b, i = ok.nonzero(as_tuple=True)
        stats.append(scored_stats(d, out[b, i], b, later[b, i], recipe.logits, targets, loss))
    return stats
