"""An independent dense reference for EAGLE-1, EAGLE-3 and MTP drafters, straight from formats.md.

Plain float64 torch over the checkpoint's own tensor names and config.json (no eyas code): dense
causal attention over one request, its own RMSNorm, rotary (HF ``rotate_half`` layout) and GQA.
A step layer's context is kept as ``{position: (token, hidden input)}``; every draft step reruns
the layer over its whole context, which for one layer equals attending over cached K/V.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def read_checkpoint(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return json.loads((folder / "config.json").read_text()), tensors


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [P, heads, d] at positions pos [P]: pairs (i, i + d/2) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    angles = pos[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [P, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def linear(W, name, x):
    out = x @ W[name + ".weight"].T
    return out + W[name + ".bias"] if name + ".bias" in W else out


def attention(W, p, c, x, pos):
    """Causal self-attention of layer prefix ``p`` (config ``c``) over x [P, in] at positions 0..P-1."""
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // nh
    theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]  # transformers 5 writes rope_parameters
    q = rope(linear(W, p + "self_attn.q_proj", x).view(len(x), nh, d), pos, theta)
    k = rope(linear(W, p + "self_attn.k_proj", x).view(len(x), nkv, d), pos, theta)
    v = linear(W, p + "self_attn.v_proj", x).view(len(x), nkv, d)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), nh * d)
    return linear(W, p + "self_attn.o_proj", out)


def mlp(W, p, x):
    return linear(W, p + "mlp.down_proj", F.silu(linear(W, p + "mlp.gate_proj", x)) * linear(W, p + "mlp.up_proj", x))


class Eagle3:
    """SafeAILab (``midlayer.``) or speculators (``layers.0.``) folder; ``embed`` [V, H] if not stored. Layers
    1.. of a drafter with ``num_hidden_layers`` > 1 are stored as ``layers.{i}.`` in both and run as plain Llama
    layers on the first layer's output (vLLM's EAGLE-3 model)."""

    def __init__(self, folder: Path, embed: torch.Tensor | None):
        cfg, W = read_checkpoint(folder)
        self.c = cfg.get("transformer_layer_config", cfg)
        self.W = {k: v.double() if v.is_floating_point() else v for k, v in W.items()}
        self.p = "layers.0." if "speculators_model_type" in cfg else "midlayer."
        self.E = self.W.get("embed_tokens.weight", None if embed is None else embed.double())
        self.num_layers, self.advance = 1, True
        # a parallel (P-EAGLE) drafter: the mask token (vLLM's ptd_token_id, speculators' mask_token_id)
        self.mask_token = cfg.get("ptd_token_id", cfg.get("mask_token_id"))

    def first_hidden(self, hidden):  # aux states [P, 3*Ht] -> g [P, H]
        return hidden @ self.W["fc.weight"].T

    def block(self, layer, tokens, g, pos):
        W, p, eps = self.W, self.p, self.c["rms_norm_eps"]
        x = torch.cat([rms(self.E[tokens], W[p + "input_layernorm.weight"], eps),
                       rms(g, W[p + "hidden_norm.weight"], eps)], -1)
        h = g + attention(W, p, self.c, x, pos)
        h = h + mlp(W, p, rms(h, W[p + "post_attention_layernorm.weight"], eps))
        for i in range(1, self.c.get("num_hidden_layers", 1)):
            q = f"layers.{i}."
            h = h + attention(W, q, self.c, rms(h, W[q + "input_layernorm.weight"], eps), pos)
            h = h + mlp(W, q, rms(h, W[q + "post_attention_layernorm.weight"], eps))
        return h

    def logits(self, layer, h):
        draft = rms(h, self.W["norm.weight"], self.c["rms_norm_eps"]) @ self.W["lm_head.weight"].T  # [Vd]
        out = torch.full((self.c["vocab_size"],), float("-inf"), dtype=torch.float64)
        out[torch.arange(len(draft)) + self.W["d2t"]] = draft
        return out


class Eagle1:
    def __init__(self, folder: Path, embed: torch.Tensor, head: torch.Tensor):
        self.c, W = read_checkpoint(folder)
        self.W = {k: v.double() for k, v in W.items()}
        self.E = self.W.get("embed_tokens.weight", embed.double())
        self.head = head.double()
        self.num_layers, self.advance = 1, True

    def first_hidden(self, hidden):
        return hidden

    def block(self, layer, tokens, f, pos):
        W = self.W
        x = linear(W, "fc", torch.cat([self.E[tokens], f], -1))
        h = x + attention(W, "layers.0.", self.c, x, pos)
        return h + mlp(W, "layers.0.", rms(h, W["layers.0.post_attention_layernorm.weight"], self.c["rms_norm_eps"]))

    def logits(self, layer, h):
        return h @ self.head.T


class Mtp:
    """MTP layers ``model.layers.{N+i}.*`` of a target folder or a separate folder."""

    def __init__(self, folder: Path, embed: torch.Tensor, head: torch.Tensor):
        self.c, W = read_checkpoint(folder)
        self.W = {k: v.double() for k, v in W.items()}
        self.E, self.head = embed.double(), head.double()
        self.num_layers = self.c["num_nextn_predict_layers"]
        self.advance = self.num_layers == 1
        self.offset = 1.0 if self.c.get("mtp_gemma_norm") else 0.0

    def first_hidden(self, hidden):
        return hidden

    def _norm(self, p, name, x):
        return rms(x, self.offset + self.W[p + name + ".weight"], self.c["rms_norm_eps"])

    def block(self, layer, tokens, prev, pos):
        p = f"model.layers.{self.c['num_hidden_layers'] + layer}."
        x = linear(self.W, p + "eh_proj", torch.cat([self._norm(p, "enorm", self.E[tokens]),
                                                      self._norm(p, "hnorm", prev)], -1))
        h = x + attention(self.W, p, self.c, self._norm(p, "input_layernorm", x), pos)
        return h + mlp(self.W, p, self._norm(p, "post_attention_layernorm", h))

    def logits(self, layer, h):
        p = f"model.layers.{self.c['num_hidden_layers'] + layer}."
        head = self.W.get(p + "shared_head.head.weight", self.head)
        return self._norm(p, "shared_head.norm", h) @ head.T


def greedy_chain(ref, tokens: list[int], hidden: torch.Tensor, k: int, select=None):
    """k greedy drafts of one request: prompt ``tokens`` (x0..x_{L+1}), target hidden [L+1, *] at 0..L.

    The draft prefill pairs token t+1 with hidden t at position t in every step layer's context;
    draft step j runs layer ``select(j)`` (default j % num_layers) at position L + j (advancing) or
    L, feeding the previous draft and the layer output. Returns (drafts [k], logits [k, V]).
    """
    select = select or (lambda j: j % ref.num_layers)
    last = len(hidden) - 1
    first = ref.first_hidden(hidden.double())
    contexts = [{t: (tokens[t + 1], first[t]) for t in range(last + 1)} for _ in range(ref.num_layers)]
    drafts, logits, pos, feedback = [], [], last, None
    for j in range(k):
        layer = select(j)
        if j > 0:
            pos += 1 if ref.advance else 0
            contexts[layer][pos] = (drafts[-1], feedback)
        ctx = contexts[layer]
        assert sorted(ctx) == list(range(pos + 1)), "a hole in the context"
        out = ref.block(layer, torch.tensor([ctx[t][0] for t in range(pos + 1)]),
                        torch.stack([ctx[t][1] for t in range(pos + 1)]), torch.arange(pos + 1))
        feedback = out[-1]
        logits.append(ref.logits(layer, feedback))
        drafts.append(int(logits[-1].argmax()))
    return drafts, torch.stack(logits)


def greedy_parallel(ref: Eagle3, tokens: list[int], hidden: torch.Tensor, k: int):
    """k greedy drafts of a parallel EAGLE-3 drafter, as k sequential calls: draft d (0..k-1) reruns the layer
    over the context 0..L+d, positions 0..L pairing token t+1 with the aux states at t (as in ``greedy_chain``),
    positions L+1..L+d the mask token with ``fc(mask_hidden)``; its last row gives the draft.
    Returns (drafts [k], logits [k, V])."""
    last = len(hidden) - 1
    first = ref.first_hidden(hidden.double())  # [L+1, H]
    mask = ref.first_hidden(ref.W["mask_hidden"].view(1, -1))  # [1, H]
    drafts, logits = [], []
    for d in range(k):
        ids = torch.tensor(tokens[1:last + 2] + [ref.mask_token] * d)
        out = ref.block(0, ids, torch.cat([first, mask.expand(d, -1)]), torch.arange(last + 1 + d))
        logits.append(ref.logits(0, out[-1]))
        drafts.append(int(logits[-1].argmax()))
    return drafts, torch.stack(logits)
