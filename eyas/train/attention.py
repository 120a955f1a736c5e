"""Attention for training: training-time test (TTT) over a padded batch, and plain causal attention.

Training runs the engine's own modules (the drafter networks, the target for ``--online``) inside a
forward context whose backend is :class:`TrainingAttention`: it ignores the paged cache and keeps,
per attention layer, the keys a later unroll step may see (:class:`LayerKeys`).

Training-time test, as it runs at inference: step 0 is the draft prefill over the whole sequence
(keys ``K0``); step ``i > 0`` re-runs the drafter at every position on its own step ``i - 1``
output. The query of step ``i`` at index ``t`` sees the step-0 keys at ``0..t`` and, from each step
``1..i``, only the key at its own index ``t`` (a diagonal per step): at inference those are the
keys of the earlier draft steps of the same chain. A drafter whose decode steps do not advance
positions (MTP with several layers) overwrites its entry at the prefix's last position instead,
so its step ``i`` sees the base keys at ``0..t-1`` and its own key only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def ttt_attention(q: torch.Tensor, base_k: torch.Tensor, base_v: torch.Tensor, diag_k: list[torch.Tensor],
                  diag_v: list[torch.Tensor], base_includes_self: bool = True) -> torch.Tensor:
    """Attention of one unroll step, without a dense ``[S*T, S*T]`` mask.

    q ``[B, T, Hq, D]``; base_k/base_v ``[B, T, Hkv, D]`` (step 0's keys); diag_k/diag_v: one
    ``[B, T, Hkv, D]`` per later step, the last being the query's own step. Returns ``[B, T, Hq, D]``.
    The query at index t sees base keys ``s <= t`` (``s < t`` with ``base_includes_self=False``) and
    the diagonal keys at index t only.

    Worked example, T = 3, step 2 (two diagonal steps), query at t = 1: keys it sees, as
    (step, index) pairs: (0, 0), (0, 1), (1, 1), (2, 1). Laid out as the dense mask over all steps
    (rows: queries of step 2, columns: keys of steps 0, 1, 2 at indices 0..2)::

                 step 0   step 1   step 2
        t = 0:   1 0 0    1 0 0    1 0 0
        t = 1:   1 1 0    0 1 0    0 1 0
        t = 2:   1 1 1    0 0 1    0 0 1

    With ``base_includes_self=False`` the step-0 block becomes strictly lower triangular.

    How: the base block is ordinary causal attention, run by a fused kernel that also gives each
    query's log-sum-exp ``L`` of its base scores; the diagonal scores ``s_j = q_t . k_j,t`` are one
    number per query and step. One softmax over both is then
    ``(e^L o_base + sum_j e^{s_j} v_j) / (e^L + sum_j e^{s_j})``, so memory stays at the inputs' size
    whatever the number of steps.
    """
    heads, dim = q.shape[2], q.shape[3]
    group = heads // base_k.shape[2]
    qh = q.transpose(1, 2)  # [B, Hq, T, D]
    # one dtype for the fused kernel: under autocast rotary leaves q, k in float32 and v in bfloat16
    kh = base_k.repeat_interleave(group, dim=2).transpose(1, 2).to(q.dtype)
    vh = base_v.repeat_interleave(group, dim=2).transpose(1, 2).to(q.dtype)
    out, lse = base_attention(qh, kh, vh, base_includes_self)  # [B, Hq, T, D], [B, Hq, T] float32
    if not diag_k:
        return out.transpose(1, 2)
    scale = 1.0 / math.sqrt(dim)
    wide = torch.promote_types(q.dtype, torch.float32)  # the combination runs in float32 at least
    keys = [k.repeat_interleave(group, dim=2).transpose(1, 2) for k in diag_k]
    values = [v.repeat_interleave(group, dim=2).transpose(1, 2).to(wide) for v in diag_v]
    scores = torch.stack([(qh * k).sum(-1).to(wide) * scale for k in keys], dim=-1)  # [B, Hq, T, n]
    top = torch.maximum(lse, scores.amax(-1)).detach()  # [B, Hq, T]
    w_base = torch.exp(lse - top)  # 0 where a query sees no base key (lse = -inf)
    w_diag = torch.exp(scores - top.unsqueeze(-1))  # [B, Hq, T, n]
    num = w_base.unsqueeze(-1) * out.to(wide) + sum(w_diag[..., j:j + 1] * v for j, v in enumerate(values))
    combined = num / (w_base + w_diag.sum(-1)).unsqueeze(-1)
    return combined.to(q.dtype).transpose(1, 2)


def base_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   include_self: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention ``[B, H, T, D]`` and each query's log-sum-exp of its scores ``[B, H, T]`` (float32),
    both differentiable. On the CPU through PyTorch's fused flash-attention kernels (no ``[T, T]`` scores
    in memory; about 6x faster forward and backward at T = 640); elsewhere computed densely."""
    if q.device.type != "cpu":
        seq = q.shape[2]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        visible = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(0 if include_self else -1)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        return torch.matmul(probs.to(v.dtype), v), lse
    return _FlashAttention.apply(q, k, v, include_self)


def _strictly_causal_bias(q: torch.Tensor) -> torch.Tensor:
    seq = q.shape[2]
    return torch.zeros(seq, seq, dtype=q.dtype, device=q.device).masked_fill(
        ~torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(-1), float("-inf"))


class _FlashAttention(torch.autograd.Function):
    """The CPU flash kernels, with a gradient for the log-sum-exp as well as for the output.

    The kernels' backward takes ``dS = P * (dO . v_s - D_t)`` with ``D_t = dO_t . o_t`` computed
    from the ``out`` it is given; a log-sum-exp gradient ``g_t`` adds ``P_ts * g_t`` (as
    ``dL_t / ds_ts = P_ts``), i.e. ``D_t`` becomes ``D_t - g_t``. Padding the head dimension with
    one extra column, 0 in q, k, v, 1 in dO and ``-g_t`` in o, makes the kernel compute exactly that
    in its one backward call (the scale is passed, so the padding leaves the scores alone; the
    extra columns of the gradients are dropped). The padding is ``PAD`` wide so rows stay
    multiples of the kernel's vector width.

    Example: one query seeing two keys with ``P = (0.25, 0.75)``, upstream ``dO = 0`` and ``g = 2``:
    ``dS = (0.5, 1.5)``, the gradient of ``2 * logsumexp(s)``.
    """

    PAD = 16

    @staticmethod
    def forward(ctx, q, k, v, include_self):
        mask = None if include_self else _strictly_causal_bias(q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=include_self,
                                                                             attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.include_self = include_self
        if not include_self:  # the kernel reports 0 for the first query, which sees no key
            lse = lse.clone()
            lse[..., 0] = float("-inf")
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dim = q.shape[-1]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        grad_lse = grad_lse.nan_to_num(0.0, posinf=0.0, neginf=0.0)

        def pad(x, first=None):  # [B, H, T, D] -> [B, H, T, D + PAD], column D = first (0 if None)
            extra = x.new_zeros(*x.shape[:-1], _FlashAttention.PAD)
            if first is not None:
                extra[..., 0] = first
            return torch.cat([x, extra], dim=-1)

        mask = None if ctx.include_self else _strictly_causal_bias(q)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            pad(grad_out, 1.0), pad(q), pad(k), pad(v), pad(out, -grad_lse.to(out.dtype)), lse, 0.0,
            ctx.include_self, attn_mask=mask, scale=1.0 / math.sqrt(dim))
        grad_q, grad_k, grad_v = (g[..., :dim] for g in grads)
        return grad_q, grad_k, grad_v, None


@dataclass
class LayerKeys:
    """One attention layer's keys over a padded ``[batch, seq_len]`` layout, kept across unroll steps.

    ``causal``: plain causal attention, nothing kept (the target's layers in ``--online`` mode).
    Otherwise the first call records the base keys (step 0, or an MTP layer's prefill) and later
    calls are unroll steps.
    """

    batch: int
    seq_len: int
    advances_positions: bool = True  # the drafter's declaration (base keys up to t, diagonals kept)
    causal: bool = False
    base: tuple[torch.Tensor, torch.Tensor] | None = None
    diagonals: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class TrainingAttention:
    """The backend of training forwards; ``kv_cache`` is ignored (nothing is paged)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, keys: LayerKeys) -> torch.Tensor:
        """q [B*T, Hq, D], k/v [B*T, Hkv, D] (flat, as the model layers hand them) -> [B*T, Hq, D]."""
        shape = (keys.batch, keys.seq_len)
        q, k, v = q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]), v.view(*shape, *v.shape[1:])
        if keys.causal or keys.base is None:
            if not keys.causal:
                keys.base = (k, v)
            out = ttt_attention(q, k, v, [], [])
        else:
            steps = keys.diagonals + [(k, v)]
            if keys.advances_positions:
                keys.diagonals = steps
            else:
                steps = steps[-1:]
            out = ttt_attention(q, *keys.base, [s[0] for s in steps], [s[1] for s in steps],
                                base_includes_self=keys.advances_positions)
        return out.reshape(-1, *out.shape[2:])
