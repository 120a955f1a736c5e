"""EAGLE-1 drafter: predicts the target's next feature; the target's own head turns it into logits.

One step (H = the target's hidden size; f = the target's last hidden state at step 0, after its
final norm, then the drafter's own output):

    x = fc(cat(embed(tok), f))                 [T, 2H] -> [T, H], with bias (see the checkpoint notes)
    h = x + attn(x)                            no input_layernorm
    h = h + mlp(post_attention_layernorm(h))   feedback: h
    logits = target.lm_head(h)                 no final norm
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.model.drafters.base import Drafter, TargetParts
from eyas.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from eyas.model.llama import Attention


class Eagle1Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(x, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Drafter(Drafter):
    """``cfg``: the drafter layer's Llama config (hidden size and vocabulary are the target's)."""

    method = "eagle"
    target_hidden = "last"

    def __init__(self, cfg: ModelConfig, target: TargetParts, *, fc_bias: bool, max_positions: int,
                 own_embedding: bool):
        super().__init__(target, cfg.vocab_size, shares_target_head=True)
        self.config = cfg
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layer = Eagle1Layer(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def attention_layers(self) -> list[Attention]:
        return [self.layer.self_attn]

    def forward(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H]: the target's last hidden state (step 0) or the previous step's feedback."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))  # [T, H]
        cos, sin = self.rotary.table(positions, x.dtype)
        h = self.layer(x, cos, sin)
        return h, h

    def compute_logits(self, step: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(hidden).float()  # [T, V]
