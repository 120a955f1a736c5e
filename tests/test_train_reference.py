"""Dense, naive reference checks of the drafter-training math (training-time test for EAGLE-3).

Every reference below is written from the index conventions, not from the code under test:

* sequence x_0 .. x_{T-1}; unroll step i at index t is fed x_{t+1+i} (0 past the end) at RoPE position
  t + i and predicts x_{t+2+i};
* the query of step i at index t sees the step-0 keys at 0..t (0..t-1 with base_includes_self=False)
  and, from each later step passed, only the key at its own index t; ONE softmax over all of them;
* p_t = softmax of the target's logits restricted to the training vocabulary, valid where t+1 < T,
  loss_mask[t+1] and the full-vocabulary argmax lies in the training vocabulary; step i at t is scored
  against p_{t+1+i}.
"""

from __future__ import annotations

import math

import pytest
import torch

from eyas.train.attention import ttt_attention

# ----------------------------------------------------------------------------------------------------------------
# dense references


def dense_mask(seq: int, num_diag: int, base_includes_self: bool = True) -> torch.Tensor:
    """[T, (n+1)*T] bool: row t (a query of the last step), column step*T + s (key of `step` at index s)."""
    mask = torch.zeros(seq, (num_diag + 1) * seq, dtype=torch.bool)
    for t in range(seq):
        for step in range(num_diag + 1):
            for s in range(seq):
                if step == 0:
                    visible = s <= t if base_includes_self else s < t
                else:
                    visible = s == t
                mask[t, step * seq + s] = visible
    return mask


def dense_attention(q, keys, values, base_includes_self=True):
    """q [B,T,Hq,D]; keys/values: lists (step 0 first) of [B,T,Hkv,D]. One softmax over all visible keys."""
    bsz, seq, heads, dim = q.shape
    kv_heads = keys[0].shape[2]
    group = heads // kv_heads
    k_all = torch.cat(keys, dim=1)  # [B, (n+1)T, Hkv, D]
    v_all = torch.cat(values, dim=1)
    mask = dense_mask(seq, len(keys) - 1, base_includes_self)
    outs = []
    for h in range(heads):
        kvh = h // group
        scores = torch.einsum("btd,bsd->bts", q[:, :, h], k_all[:, :, kvh]) / math.sqrt(dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("bts,bsd->btd", probs, v_all[:, :, kvh]))
    return torch.stack(outs, dim=2)  # [B, T, Hq, D]


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta):
    """rotate_half RoPE: x [B,T,H,D], positions [T] (same for every row)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# 1. ttt_attention against a dense mask


def test_dense_mask_matches_docstring_example():
    """T=3, two diagonal steps, row t=1 = [1,1,0 | 0,1,0 | 0,1,0]; base_includes_self=False: strict base block."""
    mask = dense_mask(3, 2).int()
    assert mask[1].tolist() == [1, 1, 0, 0, 1, 0, 0, 1, 0]
    assert mask.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    strict = dense_mask(3, 1, base_includes_self=False).int()
    assert strict.tolist() == [[0, 0, 0, 1, 0, 0],
                               [1, 0, 0, 0, 1, 0],
                               [1, 1, 0, 0, 0, 1]]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("num_diag,base_includes_self", [(0, True), (1, True), (3, True), (1, False), (3, False)])
def test_ttt_attention_matches_dense(num_diag, base_includes_self, dtype, tol):
    """out_t = sum_j softmax_j(q_t.k_j / sqrt(D)) v_j over the dense mask's keys (GQA h -> h // 2);
    output and gradients w.r.t. q, base k/v and every diagonal k/v."""
    gen = torch.Generator().manual_seed(1000 + 10 * num_diag + int(base_includes_self))
    bsz, seq, hq, hkv, dim = 2, 7, 4, 2, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rand(bsz, seq, hq, dim)
    keys = [rand(bsz, seq, hkv, dim) for _ in range(num_diag + 1)]
    values = [rand(bsz, seq, hkv, dim) for _ in range(num_diag + 1)]
    upstream = rand(bsz, seq, hq, dim)

    # the code under test, in `dtype`
    q_x = q.to(dtype).requires_grad_(True)
    keys_x = [k.to(dtype).requires_grad_(True) for k in keys]
    values_x = [v.to(dtype).requires_grad_(True) for v in values]
    out_x = ttt_attention(q_x, keys_x[0], values_x[0], keys_x[1:], values_x[1:], base_includes_self=base_includes_self)
    assert out_x.shape == (bsz, seq, hq, dim) and out_x.dtype == dtype
    grads_x = torch.autograd.grad(out_x, [q_x, *keys_x, *values_x], upstream.to(dtype))

    # the dense reference, float64, from the same (rounded) inputs
    q_r = q_x.detach().double().requires_grad_(True)
    keys_r = [k.detach().double().requires_grad_(True) for k in keys_x]
    values_r = [v.detach().double().requires_grad_(True) for v in values_x]
    out_r = dense_attention(q_r, keys_r, values_r, base_includes_self)
    grads_r = torch.autograd.grad(out_r, [q_r, *keys_r, *values_r], upstream)

    torch.testing.assert_close(out_x.double(), out_r, atol=tol, rtol=tol)
    names = ["q"] + [f"k{j}" for j in range(num_diag + 1)] + [f"v{j}" for j in range(num_diag + 1)]
    for name, g_x, g_r in zip(names, grads_x, grads_r):
        assert g_x is not None and torch.isfinite(g_x).all(), name
        torch.testing.assert_close(g_x.double(), g_r, atol=tol, rtol=tol, msg=lambda m, n=name: f"grad {n}: {m}")

    # the reference has teeth: the other base block (or no diagonals) gives a different answer
    if num_diag:
        other = dense_attention(q_r.detach(), [k.detach() for k in keys_r], [v.detach() for v in values_r],
                                not base_includes_self)
        assert (other - out_r.detach()).abs().max() > 100 * tol


# ----------------------------------------------------------------------------------------------------------------
# 2. the unroll through a real EAGLE-3 drafter, and 3. the loss

HIDDEN, VOCAB = 64, 320


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_tiny_model

    from eyas.config import ModelConfig
    from eyas.model.loader import load_model

    path = make_tiny_model(tmp_path_factory.mktemp("train_ref") / "m", "llama")
    model = load_model(ModelConfig.from_folder(path), torch.float32, torch.device("cpu"), 64)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_recipe(target, seed=0, widen=True, parallel_depths=0):
    from eyas.train.recipes import Eagle3Recipe

    torch.manual_seed(seed)
    recipe = Eagle3Recipe(target, 64, aux_layer_ids=(0, 1, 2), vocab_ids=torch.arange(0, VOCAB, 2),
                          parallel_depths=parallel_depths)
    if widen:  # the HF-style init (std 0.02, unit norms) barely lets attention matter; widen it
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 7)
            for name, p in recipe.drafter.layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.15 * torch.randn(p.shape, generator=gen))
            recipe.drafter.fc.weight.copy_(0.1 * torch.randn(recipe.drafter.fc.weight.shape, generator=gen))
            recipe.drafter.norm.weight.copy_(1.0 + 0.2 * torch.randn(HIDDEN, generator=gen))
            if parallel_depths:
                recipe.drafter.mask_hidden.copy_(torch.randn(recipe.drafter.mask_hidden.shape, generator=gen))
    return recipe


def make_batch(bsz, seq, seed, head_weight=None):
    """Random tokens, loss mask (~70% on), aux and last. With ``head_weight``: each ``last`` row leans towards
    one random head row, so the target's argmax is clear of bfloat16 rounding (scaling ``last`` would not
    help: the final RMSNorm removes the scale) and falls in or out of the even-id vocabulary at random."""
    from eyas.train.data import Batch

    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(1, VOCAB, (bsz, seq), generator=gen)
    loss_mask = torch.rand(bsz, seq, generator=gen) < 0.7
    aux = torch.randn(bsz, seq, 3 * HIDDEN, generator=gen)
    last = torch.randn(bsz, seq, HIDDEN, generator=gen)
    if head_weight is not None:
        planted = torch.randint(0, VOCAB, (bsz, seq), generator=gen)
        rows = head_weight[planted]
        last = last + math.sqrt(HIDDEN) * rows / rows.norm(dim=-1, keepdim=True)
    return Batch(token_ids, loss_mask, aux, last)


def reference_unroll(drafter, embed_weight, token_ids, aux, num_steps, *, token_shift=1, position_step=1,
                     base_includes_self=True, diagonals=True):
    """Re-implementation of the EAGLE-3 step in float64 from the drafter's weights (the keyword arguments
    exist only to build wrong variants that the implementation must NOT match)."""
    w = {name: p.detach().double() for name, p in drafter.named_parameters()}
    cfg = drafter.config
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bsz, seq = token_ids.shape
    emb_table = embed_weight.detach().double()
    keys, values, outs = [], [], []
    g = aux.double() @ w["fc.weight"].T  # step 0 only
    for step in range(num_steps):
        tok = torch.zeros(bsz, seq, dtype=torch.int64)
        for t in range(seq):
            if t + token_shift + step < seq:
                tok[:, t] = token_ids[:, t + token_shift + step]
        positions = torch.arange(seq) + position_step * step
        x = torch.cat([rms(emb_table[tok], w["layer.input_layernorm.weight"], eps),
                       rms(g, w["layer.hidden_norm.weight"], eps)], dim=-1)  # [B, T, 2H]
        qkv = x @ w["layer.self_attn.qkv_proj.weight"].T
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = rotate(q.reshape(bsz, seq, heads, dim), positions, theta)
        k = rotate(k.reshape(bsz, seq, kv_heads, dim), positions, theta)
        v = v.reshape(bsz, seq, kv_heads, dim)
        keys.append(k)
        values.append(v)
        used_k, used_v = (keys, values) if diagonals else (keys[:1] + keys[-1:], values[:1] + values[-1:])
        if step == 0:
            used_k, used_v = keys[:1], values[:1]
        attn = dense_attention(q, used_k, used_v, base_includes_self if step else True)
        h = g + attn.reshape(bsz, seq, heads * dim) @ w["layer.self_attn.o_proj.weight"].T
        gate, up = (rms(h, w["layer.post_attention_layernorm.weight"], eps)
                    @ w["layer.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        h = h + (torch.nn.functional.silu(gate) * up) @ w["layer.mlp.down_proj.weight"].T
        outs.append(rms(h, w["norm.weight"], eps))
        g = h  # feedback: the pre-norm state
    return outs


def test_unroll_matches_dense_eagle3_reference(target):
    """unroll step i at t: token x_{t+1+i}, position t+i, step-0 fc(aux) then feedback h, dense TTT mask;
    each step's normed output matches a float64 re-implementation."""
    from eyas.train.recipes import unroll

    assert target.config.rope_scaling is None
    recipe = make_recipe(target)
    batch = make_batch(2, 6, seed=3)
    num_steps = 3
    got = unroll(recipe, batch, num_steps)
    assert len(got) == num_steps
    ref = reference_unroll(recipe.drafter, target.embed_tokens.weight, batch.token_ids, batch.aux, num_steps)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == (2, 6, HIDDEN)
        torch.testing.assert_close(g.detach().double(), r, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")

    # the reference has teeth: each wrong variant is far from the implementation at some step > 0
    wrong = {
        "token shift off by one": dict(token_shift=0),
        "positions not advanced": dict(position_step=0),
        "strict base block": dict(base_includes_self=False),
        "own diagonal only": dict(diagonals=False),
    }
    for what, kwargs in wrong.items():
        bad = reference_unroll(recipe.drafter, target.embed_tokens.weight, batch.token_ids, batch.aux, num_steps,
                               **kwargs)
        gap = max((g.detach().double() - b).abs().max().item() for g, b in zip(got, bad))
        assert gap > 1e-2, f"{what}: the reference cannot tell it apart ({gap:.2e})"


def reference_targets(target, batch, vocab_ids):
    """p_t (float64) over the training vocabulary, its validity [B, T], how many candidates the argmax rule
    excludes, and the smallest |best logit in - best logit outside the vocabulary| over the candidates."""
    norm_w = target.norm.weight.double()
    head = target.lm_head.weight.double()
    states = rms(batch.last.double(), norm_w, target.config.rms_norm_eps)
    logits = states @ head.T  # [B, T, V]
    in_vocab = torch.zeros(VOCAB, dtype=torch.bool)
    in_vocab[vocab_ids] = True
    p = torch.softmax(logits[..., vocab_ids], dim=-1)
    bsz, seq = batch.token_ids.shape
    valid = torch.zeros(bsz, seq, dtype=torch.bool)
    # what decides validity: the best in-vocabulary logit against the best one outside it
    margin = (logits[..., in_vocab].amax(-1) - logits[..., ~in_vocab].amax(-1)).abs()
    excluded_by_argmax = 0
    candidate_margins = []
    for b in range(bsz):
        for t in range(seq):
            if t + 1 < seq and bool(batch.loss_mask[b, t + 1]):
                candidate_margins.append(margin[b, t].item())
                if bool(in_vocab[logits[b, t].argmax()]):
                    valid[b, t] = True
                else:
                    excluded_by_argmax += 1
    return p, valid, excluded_by_argmax, min(candidate_margins)


@pytest.mark.parametrize("chunk", [5, 128])  # rows per chunk of the fused cross-entropy: several, or one
@pytest.mark.parametrize("loss", ["soft", "hard"])
def test_step_stats_match_formulas(target, loss, chunk, monkeypatch):
    """soft: term = -sum_v p_{t+1+i}(v) log_softmax(z_t)(v), scored iff p_{t+1+i} valid; hard: -log_softmax(z_t)
    [x_{t+2+i}] where x_{t+2+i} exists, is masked in and in the vocabulary; agree = argmax z_t == argmax p_{t+1+i}."""
    from eyas.train.objective import TargetHead, _ChunkedCrossEntropy, step_stats
    from eyas.train.recipes import unroll

    monkeypatch.setattr(_ChunkedCrossEntropy, "CHUNK", chunk)
    recipe = make_recipe(target, widen=False)
    vocab_ids = torch.arange(0, VOCAB, 2)
    assert torch.equal(recipe.vocab_ids, vocab_ids)
    bsz, seq, num_steps = 3, 9, 3
    batch = make_batch(bsz, seq, seed=11, head_weight=target.lm_head.weight)
    # tokens: a mix inside (even) and outside (odd) the training vocabulary
    assert (batch.token_ids % 2 == 0).any() and (batch.token_ids % 2 == 1).any()
    assert (~batch.loss_mask[:, 1:]).any() and batch.loss_mask[:, 1:].any()

    p_ref, valid, excluded, min_margin = reference_targets(target, batch, vocab_ids)
    assert excluded > 0, "no position is excluded for an argmax outside the training vocabulary: change the seed"
    # the implementation may take the full-vocabulary argmax in bfloat16 (logits rounded to ~0.01 near 2):
    # the fixture must have no near-tie that decides validity
    assert min_margin > 0.05, f"a near-tie decides validity ({min_margin:.3g}): change the seed"

    targets = TargetHead(target.norm, target.lm_head.weight, vocab_ids).distribution(batch.last, batch.token_ids,
                                                                                      batch.loss_mask)
    assert torch.equal(targets.row >= 0, valid)
    for b in range(bsz):
        for t in range(seq):
            if valid[b, t]:
                torch.testing.assert_close(targets.probs[targets.row[b, t]].double(), p_ref[b, t], atol=1e-6, rtol=1e-4)

    outs = unroll(recipe, batch, num_steps)
    head = recipe.drafter.lm_head.weight.detach().double()
    in_vocab = {int(v): j for j, v in enumerate(vocab_ids)}
    for step, normed in enumerate(outs):
        normed = normed.detach().requires_grad_(True)
        stats = step_stats(step, normed, recipe.logits, targets, loss)
        normed_r = normed.detach().double().requires_grad_(True)
        loss_sum, count, agree = normed_r.new_zeros(()), 0, 0
        for b in range(bsz):
            for t in range(seq):
                later = t + 1 + step  # p_later is the distribution of x_{t+2+step}
                if later >= seq:
                    continue
                z = normed_r[b, t] @ head.T  # [Vd]
                log_q = torch.log_softmax(z, dim=-1)
                if loss == "soft":
                    if not valid[b, later]:
                        continue
                    loss_sum = loss_sum - (p_ref[b, later] * log_q).sum()
                else:
                    token = later + 1
                    if not (token < seq and bool(batch.loss_mask[b, token]) and int(batch.token_ids[b, token]) in in_vocab):
                        continue
                    loss_sum = loss_sum - log_q[in_vocab[int(batch.token_ids[b, token])]]
                count += 1
                if valid[b, later] and int(z.argmax()) == int(p_ref[b, later].argmax()):
                    agree += 1
        assert count > 0
        assert int(stats.count) == count, f"step {step}"
        assert int(stats.agree) == agree, f"step {step}"
        torch.testing.assert_close(stats.loss_sum.double(), loss_sum.detach(), atol=1e-5, rtol=1e-4)
        grad, = torch.autograd.grad(stats.loss_sum, normed)
        grad_r, = torch.autograd.grad(loss_sum, normed_r)
        torch.testing.assert_close(grad.double(), grad_r, atol=1e-5, rtol=1e-4)
