"""MTP drafter: DeepSeek-style multi-token-prediction layers stored with the target.

MTP layer ``i`` (decoder layer ``N + i`` of the checkpoint) at one step:

    x = eh_proj(cat(enorm(embed(tok)), hnorm(prev)))   [T, 2H] -> [T, H]
    h = decoder_block(x)                               a full Llama block; feedback: h
    logits = head(shared_head.norm(h))                 own ``shared_head.head`` or the target's lm_head

``prev`` is the target's last hidden state (after its final norm) at step 0 and the previous
step's ``h`` later. Draft step ``j`` runs layer ``j % num_mtp_layers`` (per-step layer selection);
each layer is its own KV-cache group (a sliding-window layer declares ``sliding_window``), so
slot mappings and block tables are kept per layer.

Positions: with one MTP layer, decode steps advance positions like EAGLE (the layer's cache holds
its earlier draft steps). With several, every step runs at the prefix's last position P, as in
MTP training, where depth ``j`` at index ``t`` pairs the depth ``j-1`` state at ``t`` with token
``t + j + 1`` under position ``t``. Advancing them instead would leave holes: layer 2 at P + 2
would attend to P + 1, written only into layer 1's cache. The draft prefill fills every layer's
cache over the prefix with the target's hidden states; decode step j then overwrites layer
``j % m``'s entry at P. Example with m = 2, prompt x0..x4, emitted x5:

    prefill: layer 0 and layer 1 over [x1..x5] x target h0..h4 at positions 0..4 -> layer 0: d6, f
    step 1:  layer 1, input [d6], position [4], prev f -> d7
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.model.drafters.base import Drafter, TargetParts
from eyas.model.layers import Linear, RMSNorm, RotaryEmbedding
from eyas.model.llama import Attention, DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MtpLayer(DecoderLayer):
    """A decoder block plus the MTP input fusion and head; parameter names follow the DeepSeek layout."""

    def __init__(self, cfg: ModelConfig, layer_id: int, own_head: bool, sliding_window: int | None):
        super().__init__(cfg, layer_id)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg, own_head)
        self.self_attn.sliding_window = sliding_window


class MtpDrafter(Drafter):
    """``cfg``: the target's config (an MTP block has the target's shape).

    ``sliding_windows``: one entry per MTP layer, None for full attention. ``own_heads``: each layer
    has its own ``shared_head.head`` (Step3.5); otherwise the target's lm_head is shared (DeepSeek).
    """

    method = "mtp"
    target_hidden = "last"
    owns_checkpoint_files = False

    def __init__(self, cfg: ModelConfig, target: TargetParts, *, sliding_windows: tuple[int | None, ...],
                 own_heads: bool, max_positions: int):
        super().__init__(target, cfg.vocab_size, shares_target_head=not own_heads)
        self.config = cfg
        self.num_step_layers = len(sliding_windows)
        self.advances_positions = self.num_step_layers == 1
        self.layers = nn.ModuleList(MtpLayer(cfg, cfg.num_layers + i, own_heads, window)
                                    for i, window in enumerate(sliding_windows))
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    @property
    def num_mtp_layers(self) -> int:
        return self.num_step_layers

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H]: the target's last hidden state (step 0) or the previous step's feedback."""
        layer = self.layers[step % self.num_step_layers]
        x = layer.eh_proj(torch.cat([layer.enorm(self.embed(input_ids)), layer.hnorm(hidden)], dim=-1))  # [T, H]
        cos, sin = self.rotary.table(positions, x.dtype)
        h = layer(x, cos, sin)
        return layer.shared_head.norm(h), h

    def compute_logits(self, step: int, hidden: torch.Tensor) -> torch.Tensor:
        head = self.layers[step % self.num_step_layers].shared_head.head
        return (self.target.lm_head if head is None else head)(hidden).float()  # [T, V]
