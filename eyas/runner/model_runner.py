"""Turns a scheduler plan into tensors, runs the target, samples. The only owner of device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.config import EngineConfig
from eyas.engine.scheduler import SchedulerOutput
from eyas.kv.block_pool import NULL_BLOCK
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import AttentionBatch, default_backend, get_backend
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.model.llama import ModelOutput
from eyas.model.loader import load_model
from eyas.sampling.sampler import LogprobsTensors, Sampler, SamplingBatch


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> tokens emitted this step
    logprobs: dict[str, list[dict[int, float]]]  # request id -> per emitted token {token id: logprob}


class ModelRunner:
    def __init__(self, config: EngineConfig, attention_backend: str | None = None):
        self.config = config
        self.device = config.device
        self.model = load_model(config.model, config.dtype, config.device, config.scheduler.max_model_len)
        self.backend = get_backend(attention_backend or default_backend(config.device))
        self.sampler = Sampler()
        self.block_size = config.cache.block_size
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The target's layers form one full-attention group."""
        layers = self.model.attention_layers()
        cfg = self.config.model
        per_token = 2 * cfg.num_kv_heads * cfg.head_dim * self.config.dtype.itemsize * len(layers)
        return [KVCacheGroupSpec("full_attention", tuple(f"layers.{a.layer_id}" for a in layers), per_token)]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config.model
        num_slots = num_blocks * self.block_size
        for layer in self.model.attention_layers():
            cache = torch.zeros(2, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.config.dtype,
                                device=self.device)  # [K/V, slots, kv_heads, head_dim]
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> tuple[ModelOutput, "_Inputs"]:
        """Run the target over the plan's tokens (writing their K/V into the cache)."""
        inputs = self._prepare(plan)
        with forward_context(ForwardContext(self.backend, inputs.attn_metadata)):
            return self.model(inputs.input_ids, inputs.positions), inputs

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        out, inputs = self.forward(plan)
        if not inputs.sample_rows:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(out.hidden[inputs.logits_index])  # [num_sampling, vocab]
        batch = SamplingBatch.from_params([e.request.params for e in inputs.sample_rows],
                                          [e.request.seed for e in inputs.sample_rows],
                                          [e.request.num_tokens for e in inputs.sample_rows], self.device)
        result = self.sampler.sample(logits, batch)
        tokens = result.token_ids.tolist()
        sampled = {e.request.request_id: [t] for e, t in zip(inputs.sample_rows, tokens)}
        logprobs = self._logprobs(inputs.sample_rows, tokens, result.logprobs)
        return RunnerOutput(sampled, logprobs)

    def _prepare(self, plan: SchedulerOutput) -> "_Inputs":
        input_ids, positions, q_lens, seq_lens, tables = [], [], [], [], []
        logits_index, sample_rows = [], []
        for entry in plan.scheduled:
            request, start, n = entry.request, entry.start, entry.num_new_tokens
            input_ids += request.token_ids[start:start + n]
            positions.extend(range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(entry.block_tables)
            if entry.samples:
                logits_index.append(len(input_ids) - 1)
                sample_rows.append(entry)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        attn_metadata = {}
        for group in range(len(tables[0])):
            width = max(len(t[group]) for t in tables)
            block_table = torch.full((len(tables), width), NULL_BLOCK, dtype=torch.int64)
            for row, t in enumerate(tables):
                block_table[row, :len(t[group])] = torch.tensor(t[group], dtype=torch.int64)
            slot_mapping = (block_table[req_of_token, positions_t // self.block_size] * self.block_size
                            + positions_t % self.block_size)  # [num_tokens]
            batch = AttentionBatch(query_start_loc, seq_lens_t, block_table, slot_mapping, self.block_size)
            attn_metadata[group] = self.backend.build_metadata(batch, self.device)
        return _Inputs(torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                       positions_t.to(self.device), attn_metadata,
                       torch.tensor(logits_index, dtype=torch.int64, device=self.device), sample_rows)

    @staticmethod
    def _logprobs(rows, tokens: list[int], lp: LogprobsTensors | None) -> dict[str, list[dict[int, float]]]:
        if lp is None:
            return {}
        sampled, top_ids, top_lps = lp.sampled_logprobs.tolist(), lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
        out = {}
        for i, entry in enumerate(rows):
            n = entry.request.params.logprobs
            if n is None:
                continue
            entry_lps = dict(zip(top_ids[i][:n], top_lps[i][:n]))
            entry_lps[tokens[i]] = sampled[i]
            out[entry.request.request_id] = [entry_lps]
        return out


@dataclass
class _Inputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: dict
    logits_index: torch.Tensor  # [num_sampling] row of the hidden states each sampling request reads
    sample_rows: list
