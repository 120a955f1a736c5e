"""EAGLE-3 drafter: a decoder layer over ``cat(norm(embedding), norm(hidden))``, optionally more plain
decoder layers after it, and an own draft-vocab head.

One step (H = drafter hidden, Ht = target hidden, Vd = draft vocabulary):

    g = fc(cat(a_low, a_mid, a_high))      step 0 only: [T, 3*Ht] -> [T, H]; later steps g = feedback
    x = cat(input_layernorm(embed(tok)), hidden_norm(g))          [T, 2H]
    h = g + attn(x)
    h = h + mlp(post_attention_layernorm(h))
    h = later_layer(h), for each later layer (a plain Llama layer)  feedback: h (pre-norm)
    logits = lm_head(norm(h))                                     [T, Vd] -> target ids via d2t

The layers after the first (``num_hidden_layers`` > 1, as vLLM's EAGLE-3 model runs them, stored as
``layers.1``, ``layers.2``, ... beside ``midlayer``) attend over the first layer's states. For
SmolLM2-135M on 237k regenerated tokens a second layer gave 1.467 tokens per step at k = 4 against
one layer's 1.454, at two thirds of the training speed.

Parallel drafting (P-EAGLE, ``parallel_depths`` K > 0): depth 0 is the step above over the target's aux
states; depth d = 1 .. K-1 is a row at position ``anchor + d`` fed the mask token and ``mask_hidden``
``[1, n_aux * Ht]`` (a learned stand-in for the aux states, through the same ``fc``), predicting the token
d places after depth 0's. All depths run in one forward; ``eyas.spec_decode.speculator`` lays them out.

The aux states are concatenated in ascending layer order, as the target's
``ModelOutput.aux_hidden.flatten(1)`` lays them out.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.model.drafters.base import Drafter, TargetParts
from eyas.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from eyas.model.llama import Attention, DecoderLayer


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, emb: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # [T, 2H]
        h = g + self.self_attn(x, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(Drafter):
    """``cfg``: the drafter layers' Llama config (its ``vocab_size`` is the target's, ``num_layers`` the
    decoder layers: the first one over embedding and hidden state, the others plain).

    ``own_embedding``: the checkpoint carries ``embed_tokens.weight`` ([V, H]); otherwise the
    target's embedding is shared, which needs H == Ht.
    """

    method = "eagle3"
    target_hidden = "aux"

    def __init__(self, cfg: ModelConfig, target: TargetParts, *, target_hidden_size: int, draft_vocab_size: int,
                 aux_layer_ids: tuple[int, ...], max_positions: int, own_embedding: bool,
                 parallel_depths: int = 0, mask_token_id: int = 0):
        super().__init__(target, cfg.vocab_size, shares_target_head=False)
        self.parallel_depths = parallel_depths
        self.mask_token_id = mask_token_id  # the token id fed at depths >= 1 (parallel drafters only)
        if parallel_depths:
            self.mask_hidden = nn.Parameter(torch.zeros(1, len(aux_layer_ids) * target_hidden_size))  # [1, n_aux*Ht]
        self.config = cfg
        self.aux_layer_ids = tuple(sorted(aux_layer_ids))
        self.target_hidden_size = target_hidden_size
        self.draft_vocab_size = draft_vocab_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = Linear(len(aux_layer_ids) * target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg)
        self.later_layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(1, cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))  # [Vd]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # [V]
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Fill d2t and t2d from the draft vocabulary's target ids (ascending, ``[Vd]``)."""
        assert target_ids.shape == (self.draft_vocab_size,) and bool((target_ids.diff() > 0).all())
        ids = target_ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(self.draft_vocab_size, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def attention_layers(self) -> list[Attention]:
        return [self.layer.self_attn] + [layer.self_attn for layer in self.later_layers]

    def forward(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: step 0 ``[T, 3*Ht]`` aux states, later steps ``[T, H]`` feedback."""
        g = self.fc(hidden) if step == 0 else hidden  # [T, H]
        cos, sin = self.rotary.table(positions, g.dtype)
        h = self.layer(self.embed(input_ids), g, cos, sin)  # [T, H]
        for layer in self.later_layers:
            h = layer(h, cos, sin)
        return self.norm(h), h

    def mask_inputs(self, num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of ``num_rows`` mask rows: token ids [n] and step-0 hidden [n, n_aux * Ht]."""
        ids = torch.full((num_rows,), self.mask_token_id, dtype=torch.int64, device=device)
        return ids, self.mask_hidden.expand(num_rows, -1)

    def compute_logits(self, step: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (normed) -> float32 logits [T, V]; target ids outside the draft vocabulary get -inf."""
        draft = self.lm_head(hidden).float()  # [T, Vd]
        target_ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t  # [Vd]
        logits = draft.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        return logits.index_copy_(1, target_ids, draft)
