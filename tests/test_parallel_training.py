"""Training a parallel (P-EAGLE) drafter against references written from the rules, not from the code:

* rows are named (depth, anchor); depth 0 runs at every index t, fed x_{t+1} and fc(aux_t) at position t;
  depth d >= 1 runs at its sampled anchors a, fed the mask token and fc(mask_hidden) at position a + d;
* (0, t) sees (0, s) for s <= t; (d, a) sees (0, s) for s <= a and (j, a) for 1 <= j <= d; one softmax;
* row (d, a) is scored against p_{a+1+d} (the target's distribution of x_{a+2+d}) where that is valid.
"""

from __future__ import annotations

import pytest
import torch
from test_train_reference import HIDDEN, make_batch, make_recipe, reference_targets, rms, rotate, target  # noqa: F401

from eyas.train.parallel import depth_counts, depth_stats, forward_depths, plan_anchors


def rows_of(seq: int, anchors: list[int], counts: list[int]) -> list[tuple[int, int]]:
    """The (depth, anchor) rows of one sequence: every index at depth 0, then depth d at anchors[:counts[d]]."""
    return [(0, t) for t in range(seq)] + [(d, a) for d in range(1, len(counts)) for a in anchors[:counts[d]]]


def visible(query: tuple[int, int], key: tuple[int, int], *, base_up_to_position=False, all_depths=False) -> bool:
    """The training mask's rule (keyword arguments build wrong variants only)."""
    (dq, aq), (dk, ak) = query, key
    if dk == 0:
        return ak <= (aq + dq if base_up_to_position else aq)
    return dq >= 1 and ak == aq and (all_depths or dk <= dq)


def test_docstring_mask_example():
    """eyas.train.parallel's worked example: T = 4, K = 3, order [2, 0, 3, 1], n = [4, 2, 1]."""
    assert depth_counts(4, 3, 0.5, 0.05) == [4, 2, 1]
    rows = rows_of(4, [2, 0, 3, 1], [4, 2, 1])
    assert rows == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 0), (2, 2)]
    dense = [[int(visible(q, k)) for k in rows] for q in rows]
    assert dense == [[1, 0, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0, 0],
                     [1, 1, 1, 0, 1, 0, 0],
                     [1, 0, 0, 0, 0, 1, 0],
                     [1, 1, 1, 0, 1, 0, 1]]


def test_depth_counts_and_anchor_plan():
    """n_d = max(ceil(T keep^d), ceil(T floor)), non-increasing; anchors: distinct, scored ones first."""
    assert depth_counts(100, 6, 0.5, 0.05) == [100, 50, 25, 13, 7, 5]
    assert depth_counts(10, 4, 1.0, 0.05) == [10, 10, 10, 10]
    scored = torch.rand(3, 40, generator=torch.Generator().manual_seed(1)) < 0.4
    anchors = plan_anchors(scored, 30, torch.Generator().manual_seed(2))
    for b in range(3):
        order = anchors[b].tolist()
        assert len(set(order)) == 30
        flags = [bool(scored[b, a]) for a in order]
        assert flags == sorted(flags, reverse=True)  # every scored anchor before any unscored one
        assert sum(flags) == min(30, int(scored[b].sum()))


def reference_depths(drafter, embed_weight, token_ids, aux, anchors, counts, **variant):
    """Float64 dense re-implementation over all rows of each sequence -> per depth [B, n_d, H] normed outputs."""
    w = {name: p.detach().double() for name, p in drafter.named_parameters()}
    cfg = drafter.config
    eps, heads, kv_heads, dim = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    offset = variant.pop("offset", True)
    emb = embed_weight.detach().double()
    bsz, seq = token_ids.shape
    out = [torch.zeros(bsz, n, HIDDEN, dtype=torch.float64) for n in counts]
    for b in range(bsz):
        rows = rows_of(seq, anchors[b].tolist(), counts)
        tok = torch.tensor([(int(token_ids[b, a + 1]) if a + 1 < seq else 0) if d == 0 else drafter.mask_token_id
                            for d, a in rows])
        fused = torch.stack([aux[b, a].double() if d == 0 else w["mask_hidden"][0] for d, a in rows]) @ w["fc.weight"].T
        pos = torch.tensor([a + (d if offset else 0) for d, a in rows])
        x = torch.cat([rms(emb[tok], w["layer.input_layernorm.weight"], eps),
                       rms(fused, w["layer.hidden_norm.weight"], eps)], dim=-1)  # [R, 2H]
        q, k, v = (x @ w["layer.self_attn.qkv_proj.weight"].T).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q = rotate(q.view(1, len(rows), heads, dim), pos, cfg.rope_theta)[0]
        k = rotate(k.view(1, len(rows), kv_heads, dim), pos, cfg.rope_theta)[0].repeat_interleave(heads // kv_heads, 1)
        v = v.view(len(rows), kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
        mask = torch.tensor([[visible(qr, kr, **variant) for kr in rows] for qr in rows])  # [R, R]
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
        h = fused + attn.reshape(len(rows), -1) @ w["layer.self_attn.o_proj.weight"].T
        gate, up = (rms(h, w["layer.post_attention_layernorm.weight"], eps) @ w["layer.mlp.gate_up_proj.weight"].T).chunk(2, -1)
        h = h + (torch.nn.functional.silu(gate) * up) @ w["layer.mlp.down_proj.weight"].T
        normed = rms(h, w["norm.weight"], eps)
        seen = [0] * len(counts)
        for r, (d, _) in enumerate(rows):
            out[d][b, seen[d]] = normed[r]
            seen[d] += 1
    return out


def test_forward_depths_match_dense_reference(target):  # noqa: F811
    recipe = make_recipe(target, parallel_depths=4)
    batch = make_batch(2, 9, seed=4)
    counts = depth_counts(9, 4, 0.6, 0.1)
    anchors = plan_anchors(torch.ones(2, 9, dtype=torch.bool), counts[1], torch.Generator().manual_seed(3))
    got = forward_depths(recipe, batch, anchors, counts)
    ref = reference_depths(recipe.drafter, target.embed_tokens.weight, batch.token_ids, batch.aux, anchors, counts)
    assert [tuple(g.shape) for g in got] == [(2, n, HIDDEN) for n in counts]
    for d, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g.detach().double(), r, atol=1e-4, rtol=1e-4, msg=lambda m, d=d: f"depth {d}: {m}")
    wrong = {"positions without the depth offset": dict(offset=False),
             "base keys up to the row's position": dict(base_up_to_position=True),
             "later depths of the anchor visible": dict(all_depths=True)}
    for what, variant in wrong.items():
        bad = reference_depths(recipe.drafter, target.embed_tokens.weight, batch.token_ids, batch.aux, anchors, counts,
                               **variant)
        gap = max((g.detach().double() - b).abs().max().item() for g, b in zip(got, bad))
        assert gap > 1e-2, f"{what}: the reference cannot tell it apart ({gap:.2e})"


def test_depth_losses_equal_reference_targets(target):  # noqa: F811
    """Each depth's loss sum and count: soft cross-entropy of row (d, a) against p_{a+1+d}, where valid."""
    from eyas.train.objective import TargetHead

    recipe = make_recipe(target, widen=False, parallel_depths=3)
    vocab_ids = torch.arange(0, 320, 2)
    batch = make_batch(3, 10, seed=11, head_weight=target.lm_head.weight)
    p_ref, valid, _, _ = reference_targets(target, batch, vocab_ids)
    targets = TargetHead(target.norm, target.lm_head.weight, vocab_ids).distribution(batch.last, batch.token_ids,
                                                                                      batch.loss_mask)
    stats = depth_stats(recipe, batch, targets, 3, 0.5, 0.05, generator=torch.Generator().manual_seed(6))
    counts = depth_counts(10, 3, 0.5, 0.05)
    scored = torch.nn.functional.pad(valid[:, 2:], (0, 2), value=False)
    anchors = plan_anchors(scored, counts[1], torch.Generator().manual_seed(6))  # the same draw
    ref = reference_depths(recipe.drafter, target.embed_tokens.weight, batch.token_ids, batch.aux, anchors, counts)
    head = recipe.drafter.lm_head.weight.detach().double()
    for d, normed in enumerate(ref):
        at = list(range(10)) if d == 0 else None
        loss, count = 0.0, 0
        for b in range(3):
            for i, a in enumerate(at if at is not None else anchors[b, :counts[d]].tolist()):
                later = a + 1 + d
                if later < 10 and valid[b, later]:
                    loss -= float((p_ref[b, later] * torch.log_softmax(normed[b, i] @ head.T, -1)).sum())
                    count += 1
        assert count > 0 and int(stats[d].count) == count, d
        assert float(stats[d].loss_sum.detach()) == pytest.approx(loss, rel=1e-4), d
