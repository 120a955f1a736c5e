"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with QKV bias, Qwen3 with QK norm).

Written for paged attention: the model sees a flat batch of ``num_tokens`` tokens from many
requests; the attention layers find their per-batch metadata in the forward context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.model import quantized
from eyas.model.forward_context import get_forward_context
from eyas.model.fused_decoder import FusedDecoder
from eyas.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [num_tokens, hidden] after the final norm (what the head reads)
    aux_hidden: torch.Tensor | None  # [num_tokens, num_aux_layers, hidden] residual stream at aux ids


CACHE_BINDINGS = 0  # KV caches bound to attention layers so far, in this process


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None):
        """``input_size``: width of the input when it is not ``hidden_size`` (an EAGLE-3 drafter attends
        over ``cat(norm(embedding), norm(hidden))``, 2 * hidden wide)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.layer_id = layer_id
        self.kv_cache_group = 0
        self.kv_cache = None  # [2, num_slots, kv_heads, head_dim], bound by the runner
        # keys a query may see, itself included (None = all): declared by a drafter's sliding-window
        # layer; its KV-cache group's attention metadata applies it
        self.sliding_window: int | None = None

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        global CACHE_BINDINGS
        CACHE_BINDINGS += 1  # plans holding the caches' addresses (eyas.model.fused_decoder) are stale now
        self._kv_cache = cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        # views, not copies or splits (a decode step is bound by its count of ops: narrow is a third of split's cost)
        qkv = self.qkv_proj(x).view(num_tokens, heads + 2 * kv_heads, self.head_dim)  # [T, H + 2 KVH, D]
        qk, v = qkv.narrow(1, 0, heads + kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk.narrow(1, 0, heads)), self.k_norm(qk.narrow(1, heads, kv_heads))], dim=1)
        qk = apply_rotary(qk, cos, sin)  # [T, H + KVH, D]: q and k heads rotated in one call
        q, k = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads)  # [T, H, D], [T, KVH, D]
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata[self.kv_cache_group])
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, aux_layer_ids: tuple[int, ...] = ()):
        super().__init__()
        self.config = cfg
        self.set_aux_layer_ids(aux_layer_ids)
        # built on the meta device and filled by the loader: no initial values (a meta tensor's normal_ imports
        # torch._dynamo, about a second of start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # (precision changes and KV cache bindings so far, the plan made after them)
        self._fused: tuple[tuple[int, int] | None, FusedDecoder | None] = (None, None)

    def set_aux_layer_ids(self, aux_layer_ids: tuple[int, ...]) -> None:
        """Which residual streams ``forward`` hands back as aux hidden states (vLLM convention)."""
        num_layers = self.config.num_layers
        for layer_id in aux_layer_ids:
            if not 0 <= layer_id <= num_layers:
                raise ValueError(f"aux_layer_ids: {layer_id} is outside [0, {num_layers}] "
                                 f"(0 = embeddings, {num_layers} = after the last layer)")
        self.aux_layer_ids = tuple(aux_layer_ids)

    def tie_weights(self) -> None:
        """Share the embedding with the head (again after ``materialize``, which unties parameters)."""
        if self.config.tie_word_embeddings and isinstance(self.embed_tokens, nn.Embedding):  # not a quantized table
            self.lm_head.weight = self.embed_tokens.weight

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None) -> ModelOutput:
        """input_ids, positions: [num_tokens]. Aux id k = the stream entering layer k (vLLM convention);
        aux states are stacked in the order of ``aux_layer_ids``.

        ``num_layers`` runs only the first layers, then the final norm (a self-speculation drafter); aux ids past
        them are left out.
        """
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.table(positions, h.dtype)
        stop = len(self.layers) if num_layers is None else min(num_layers, len(self.layers))
        aux_at = tuple(i for i in self.aux_layer_ids if i <= stop)
        hidden, aux_hidden = self._layer_runner(h)(h, cos, sin, stop, aux_at)
        return ModelOutput(hidden=hidden, aux_hidden=aux_hidden)

    def _layer_runner(self, h: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        """``run(h, cos, sin, stop, aux_at)`` -> (the final norm of h after layers [0, stop), the streams entering
        layers ``aux_at`` stacked [T, len(aux_at), hidden] or None): one C call where the layers' kernels allow it
        (``fused_decoder.py``; the plan is made once per set of KV caches), else module by module."""
        if h.is_cpu:
            # the plan holds the KV caches' addresses and the products' kernel calls (their precision): made anew
            # after either changes (comparing the 30 caches' addresses every step cost a batch-1 step 40 us)
            changes = (quantized.PRECISION_CHANGES, CACHE_BINDINGS)
            if self._fused[0] != changes:
                plain = all(type(layer) is DecoderLayer for layer in self.layers)  # what the C loop mirrors
                self._fused = changes, FusedDecoder.build(self.layers, self.norm) if plain else None
            fused = self._fused[1]
            meta = None if fused is None else fused.metadata(h)
            if meta is not None:
                return functools.partial(fused.run, meta=meta)
        return self._run_modules

    def _run_modules(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stop: int, aux_at: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        aux = {}
        # islice, not self.layers[a:b]: slicing a ModuleList builds a new one (30 add_module calls per step)
        for i, layer in enumerate(islice(self.layers, stop)):
            if i in aux_at:
                aux[i] = h
            h = layer(h, cos, sin)
        aux[stop] = h
        return self.norm(h), torch.stack([aux[i] for i in aux_at], dim=1) if aux_at else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def load_name(self, hf_name: str) -> tuple[str, int | None, int] | None:
        """Map an HF tensor name to (parameter name, shard index in a fused weight, number of shards).

        Returns None for tensors the model does not use (rotary buffers, MTP layers past N).
        """
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):
            if int(name.split(".")[1]) >= self.config.num_layers:
                return None
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        for part, fused, index, count in (("q_proj", "qkv_proj", 0, 3), ("k_proj", "qkv_proj", 1, 3),
                                          ("v_proj", "qkv_proj", 2, 3), ("gate_proj", "gate_up_proj", 0, 2),
                                          ("up_proj", "gate_up_proj", 1, 2)):
            if f".{part}." in name:
                return name.replace(part, fused), index, count
        return name, None, 1
