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

**CUDA graphs** (as for the target, ``eyas.model.cuda_graphs``): draft steps run over rows padded
up the batch-size ladder with block tables padded to ``table_width``, and replay one graph per
(batch, table width); the catch-up forward is graphed like the target's verification forward
when every query fits k + 1 rows. On the CPU the same step runs eagerly, unpadded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from eyas.config import EngineConfig, ModelConfig
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import block_table_tensor, default_backend, get_backend
from eyas.model.cuda_graphs import engine_graphs, pad_table
from eyas.model.host_memory import cache_zeros
from eyas.model.layout_forward import CacheGroup, LayoutForward, model_step
from eyas.model.loader import load_model
from eyas.model.resolve import resolve_model
from eyas.spec_decode.draft_sampling import DraftSampler
from eyas.spec_decode.options import MethodOptions, option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput


@dataclass(frozen=True)
class DraftModelOptions(MethodOptions):
    model: str | None = option(None, "draft_model: a smaller model with the target's vocabulary (HF folder or .gguf); "
                               "eagle, eagle3, mtp: the drafter's checkpoint folder", flag="--spec-model", parse=str)
    draft_num_layers: int | None = option(None, "draft_model: self-speculation with the target's first N layers",
                                          flag="--spec-draft-layers", parse=int)

    def validate(self) -> None:
        if (self.model is None) == (self.draft_num_layers is None):
            raise ValueError("speculative_config: method 'draft_model' needs exactly one of 'model' "
                             "(a smaller LM with the target's vocabulary) or 'draft_num_layers' "
                             "(self-speculation with the target's first layers)")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative_config.draft_num_layers: {self.draft_num_layers} must be >= 1")


class DraftModelProposer(Proposer):
    method = "draft_model"
    Options = DraftModelOptions

    def __init__(self, spec, config: EngineConfig, target):
        self.k = spec.num_speculative_tokens
        self.verification = spec.verification
        self.device, self.dtype = config.device, config.dtype
        self.block_size = config.cache.block_size
        backend = get_backend(default_backend(config.device))
        self.max_blocks = config.max_blocks_per_request
        options = spec.options
        if options.model is None:
            num_target_layers = config.model.num_layers
            if options.draft_num_layers >= num_target_layers:
                raise ValueError(f"speculative_config.draft_num_layers: {options.draft_num_layers} must be below "
                                 f"the target's {num_target_layers} layers")
            self.model, num_layers, group = target, options.draft_num_layers, 0  # the target's own cache
            self.draft_config = None
        else:
            path = resolve_model(options.model)
            self.draft_config = ModelConfig.from_folder(path)
            _check_same_vocabulary(config.model, self.draft_config)
            self.model = load_model(self.draft_config, config.dtype, config.device, config.max_positions)
            num_layers, group = None, None  # the group index is given by bind_kv_caches
        self.step_fn = model_step(self.model, num_layers)
        # the catch-up forward over the verification layout, and the graphed decode steps
        self.layout_forward = LayoutForward(backend, engine_graphs(config, backend),
                                            [CacheGroup(group)] if group is not None else [], self.block_size,
                                            self.max_blocks, self.device)

    @property
    def group(self) -> int:
        """The KV-cache group the draft layers read and write (the layout forward's one group)."""
        return self.layout_forward.groups[0].index

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        if self.draft_config is None:
            return []  # shares the target's cache
        cfg, layers = self.draft_config, self.model.attention_layers()
        per_token = 2 * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize * len(layers)
        return [KVCacheGroupSpec("draft_model", tuple(f"draft.layers.{a.layer_id}" for a in layers), per_token)]

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        if self.draft_config is None:
            return
        self.layout_forward.groups = [CacheGroup(first_group)]
        cfg = self.draft_config
        for layer in self.model.attention_layers():
            layer.kv_cache_group = first_group
            layer.kv_cache = cache_zeros((2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim), self.dtype,
                                    self.device)  # [K/V, slots, kv_heads, head_dim]

    def _catch_up(self, inp: ProposerInput) -> None:
        """Write the draft model's K/V for every token of the verification layout."""
        table = block_table_tensor([t[self.group] for t in inp.block_tables])
        self.layout_forward("catch_up", self.step_fn, inp.input_ids, inp.positions, inp.query_start_loc, inp.seq_lens,
                            [table], self.k)

    @torch.inference_mode()
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        if self.draft_config is not None:
            self._catch_up(inp)
        num_rows, dev = len(inp.sample_rows), self.device
        if num_rows == 0:
            return ProposerOutput(torch.zeros(0, self.k, dtype=torch.int64, device=dev),
                                  torch.zeros(0, dtype=torch.int64, device=dev))
        table = block_table_tensor([inp.block_tables[b][self.group] for b in inp.sample_rows])
        history = torch.tensor([len(t) for t in inp.token_ids], dtype=torch.int64, device=dev)
        pos = history + inp.num_emitted - 1  # [R] position of the last emitted token
        x = inp.emitted.gather(1, (inp.num_emitted - 1)[:, None]).squeeze(1)  # [R]
        # rows padded up the graphs' ladder (padding rows write the null block); exact on the CPU
        size, blocks = self.layout_forward.padded(num_rows, table.shape[1])
        table_in = pad_table(table, size, blocks).to(dev)
        x_in = torch.zeros(size, dtype=torch.int64, device=dev)
        pos_in = torch.zeros(size, dtype=torch.int64, device=dev)
        ones = torch.ones(size, dtype=torch.int64, device=dev)
        sampler = DraftSampler(inp, self.verification, dev)
        drafts = []
        for _ in range(self.k):
            x_in[:num_rows], pos_in[:num_rows] = x, pos
            hidden = self.layout_forward.step("decode", self.step_fn, x_in, pos_in, ones, pos_in + 1, [table_in])
            x = sampler.sample(self.model.compute_logits(hidden[0][:num_rows]), pos + 1)  # [R]
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
