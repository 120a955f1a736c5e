"""Draft-model proposer: a smaller causal LM, or the target's own first layers, drafting k tokens.

Two drafters behind one class:

* ``model``: a separate LM with the target's vocabulary. Its layers form their own KV-cache
  group (own block table per request, truncated with the target's). Each step it first runs a
  *catch-up* forward over the target's verification layout (prompt chunks, last tokens and
  drafts, rejected ones included: their slots are rewritten later), so its cache holds every
  committed token, then k single-token draft steps.
* ``draft_num_layers``: self-speculation with the target's first L layers, its final norm and
  head, sharing the target's weights *and* KV cache: the first L layers compute exactly the K/V
  the target computes for the same tokens, so no catch-up and no extra cache are needed. Draft
  steps write K/V for draft positions, which the next verification forward rewrites.

Draft step j of row r feeds token x at position P_r + j, where P_r is the position of the last
emitted token, and samples the token at position P_r + j + 1 with the noise the target will
use there (shared-noise mode) or with its own stream (rejection mode, keeping q).
No device-to-host sync: positions, slots and sequence lengths stay on the device; host-side
sizes are upper bounds.
"""

from __future__ import annotations

import json

import torch

from eyas.config import EngineConfig, ModelConfig
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import AttentionBatch, block_table_tensor, default_backend, get_backend, layout_slots
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.model.loader import load_model
from eyas.model.resolve import resolve_model
from eyas.spec.draft_sampling import DraftSampler
from eyas.spec.proposer import Proposer, ProposerInput, ProposerOutput


class DraftModelProposer(Proposer):
    method = "draft_model"
    config_fields = frozenset({"model", "draft_num_layers"})

    @classmethod
    def validate_config(cls, config) -> None:
        if (config.model is None) == (config.draft_num_layers is None):
            raise ValueError("speculative_config: method 'draft_model' needs exactly one of 'model' "
                             "(a smaller LM with the target's vocabulary) or 'draft_num_layers' "
                             "(self-speculation with the target's first layers)")

    def __init__(self, spec, config: EngineConfig, target):
        self.k = spec.num_speculative_tokens
        self.verification = spec.verification
        self.device, self.dtype = config.device, config.dtype
        self.block_size = config.cache.block_size
        self.backend = get_backend(default_backend(config.device))
        if spec.model is None:
            num_target_layers = config.model.num_layers
            if spec.draft_num_layers >= num_target_layers:
                raise ValueError(f"speculative_config.draft_num_layers: {spec.draft_num_layers} must be below "
                                 f"the target's {num_target_layers} layers")
            self.model, self.num_layers, self.group = target, spec.draft_num_layers, 0
            self.draft_config = None
        else:
            path = resolve_model(spec.model)
            self.draft_config = ModelConfig.from_folder(path)
            _check_same_vocabulary(config.model, self.draft_config)
            self.model = load_model(self.draft_config, config.dtype, config.device, config.max_positions)
            self.num_layers, self.group = None, None  # group index is given by bind_kv_caches

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        if self.draft_config is None:
            return []  # shares the target's cache
        cfg, layers = self.draft_config, self.model.attention_layers()
        per_token = 2 * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize * len(layers)
        return [KVCacheGroupSpec("draft_model", tuple(f"draft.layers.{a.layer_id}" for a in layers), per_token)]

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        if self.draft_config is None:
            return
        self.group = first_group
        cfg = self.draft_config
        for layer in self.model.attention_layers():
            layer.kv_cache_group = first_group
            layer.kv_cache = torch.zeros(2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim,
                                         dtype=self.dtype, device=self.device)

    def _forward(self, input_ids, positions, batch: AttentionBatch) -> torch.Tensor:
        meta = {self.group: self.backend.build_metadata(batch, self.device)}
        with forward_context(ForwardContext(self.backend, meta)):
            return self.model(input_ids, positions, num_layers=self.num_layers).hidden

    def _catch_up(self, inp: ProposerInput) -> None:
        """Write the draft model's K/V for every token of the verification layout."""
        qsl, seq_lens = inp.query_start_loc, inp.seq_lens
        table = block_table_tensor([t[self.group] for t in inp.block_tables])
        _, slots = layout_slots(table, qsl, seq_lens, self.block_size)
        q_lens = qsl[1:] - qsl[:-1]
        batch = AttentionBatch(qsl, seq_lens, table, slots, self.block_size, int(q_lens.max()), int(seq_lens.max()))
        self._forward(inp.input_ids, inp.positions, batch)

    @torch.inference_mode()
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        if self.draft_config is not None:
            self._catch_up(inp)
        num_rows, dev = len(inp.sample_rows), self.device
        if num_rows == 0:
            return ProposerOutput(torch.zeros(0, self.k, dtype=torch.int64, device=dev),
                                  torch.zeros(0, dtype=torch.int64, device=dev))
        table = block_table_tensor([inp.block_tables[b][self.group] for b in inp.sample_rows]).to(dev)
        history = torch.tensor([len(t) for t in inp.token_ids], dtype=torch.int64, device=dev)
        pos = history + inp.num_emitted - 1  # [R] position of the last emitted token
        x = inp.emitted.gather(1, (inp.num_emitted - 1)[:, None]).squeeze(1)  # [R]
        max_seq = max(len(t) for t in inp.token_ids) + inp.emitted.shape[1] + self.k
        qsl = torch.arange(num_rows + 1, device=dev)
        sampler = DraftSampler(inp, self.verification, dev)
        drafts = []
        for _ in range(self.k):
            slots = table.gather(1, (pos // self.block_size)[:, None]).squeeze(1) * self.block_size \
                + pos % self.block_size
            attn = AttentionBatch(qsl, pos + 1, table, slots, self.block_size, 1, max_seq)
            logits = self.model.compute_logits(self._forward(x, pos, attn))  # [R, vocab]
            x = sampler.sample(logits, pos + 1)
            drafts.append(x)
            pos = pos + 1
        return ProposerOutput(torch.stack(drafts, dim=1), torch.full((num_rows,), self.k, device=dev),
                              sampler.draft_probs())


def _check_same_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"speculative_config.model: draft vocabulary size {draft.vocab_size} differs from the "
                         f"target's {target.vocab_size} (draft: {draft.path}); a draft model must share the "
                         f"target's tokenizer")
    target_tok, draft_tok = target.path / "tokenizer.json", draft.path / "tokenizer.json"
    if target_tok.is_file() and draft_tok.is_file():
        vocab_a = json.loads(target_tok.read_text())["model"].get("vocab")
        vocab_b = json.loads(draft_tok.read_text())["model"].get("vocab")
        if vocab_a != vocab_b:
            raise ValueError(f"speculative_config.model: draft tokenizer differs from the target's "
                             f"(draft: {draft_tok}, target: {target_tok}); a draft model must share the "
                             f"target's tokenizer")
