"""The autoregressive speculator shared by EAGLE, EAGLE-3 and MTP drafters.

Every step, right after verification and before any device-to-host copy:

1. **Draft prefill** over the verification forward's own token layout (all scheduled requests,
   prompt chunks and rejected drafts included), with the target's positions, sequence lengths
   and hidden states: the token at position ``t + 1`` is paired with the target's state at ``t``
   (aux states for EAGLE-3, the last hidden state for EAGLE-1 and MTP). For a sampling request
   the layout rows of its last committed token and drafts take the tokens verification just
   emitted (accepted drafts, then the recovered or bonus token); rows past the first rejection
   get throw-away tokens and their cache entries are rewritten by later steps. Each step layer
   (MTP: each MTP layer) writes its own KV-cache group over the layout.
2. The row of the last emitted token's predecessor gives the first draft, sampled at the
   position where it will be verified (``eyas.spec.draft_sampling``).
3. **Draft decode**: k-1 single-token steps fed with the previous draft and the previous step's
   feedback hidden state, using step layer ``j % num_step_layers``. Positions advance one per
   step unless the drafter declares otherwise; a drafter whose positions stay put overwrites its
   entry at the last position, which is restored afterwards, so later steps see the prefill's.

Example (EAGLE-3, k = 3): history x0..x4, layout [x4, d5, d6] at positions 4..6, verification
accepted d5 and emitted [x5 = d5, x6]. Prefill rows 4, 5, 6 get tokens [x5, x6, junk] with aux
states of positions 4..6; row 5 (x6 with the state at 5) drafts x7 at position 7; decode steps
at positions 6 and 7 draft x8 and x9.

No device-to-host sync: row indices come from host-side layout sizes plus the device-side
number of emitted tokens; host-side sizes are only upper bounds for attention metadata.

Prefix caching shares the drafter's blocks with the target's. A drafter entry at position ``t``
depends on token ``t + 1``, so the last entry of a shared block was computed with the token that
followed it in the request that filled it; a request that shares the block but continues
differently drafts from that one stale entry until it falls out of view. Outputs are unaffected
(verification is lossless); only acceptance can dip on such requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch

from eyas.config import EngineConfig
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import AttentionBatch, block_table_tensor, default_backend, get_backend, layout_slots
from eyas.model.drafters.checkpoint import load_drafter
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.spec.draft_sampling import DraftSampler
from eyas.spec.proposer import Proposer, ProposerInput, ProposerOutput


class HiddenStateSpeculator(Proposer):
    config_fields = frozenset({"model"})
    method: ClassVar[str]

    @classmethod
    def validate_config(cls, config) -> None:
        if config.model is None and cls.method != "mtp":
            raise ValueError(f"speculative_config.model: method '{cls.method}' needs the drafter checkpoint folder")

    @classmethod
    def default_num_speculative_tokens(cls, config: dict) -> int | None:
        """A speculators-format checkpoint names its k (``proposal_methods[0].speculative_tokens``)."""
        config_file = Path(config.get("model") or "") / "config.json"
        if not config.get("model") or not config_file.is_file():
            return None
        methods = json.loads(config_file.read_text()).get("speculators_config", {}).get("proposal_methods") or [{}]
        return methods[0].get("speculative_tokens")

    def __init__(self, spec, config: EngineConfig, target):
        path = spec.model if spec.model is not None else config.model.path  # MTP layers inside the target
        self.drafter = load_drafter(path, target, dtype=config.dtype, device=config.device,
                                    max_positions=config.max_positions, method=self.method)
        self.aux_layer_ids = self.drafter.aux_layer_ids
        self.needs_hidden_states = self.drafter.target_hidden == "last"
        self.k = spec.num_speculative_tokens
        self.verification = spec.verification
        self.device, self.dtype = config.device, config.dtype
        self.block_size = config.cache.block_size
        self.backend = get_backend(default_backend(config.device))
        self.layers = self.drafter.attention_layers()

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        return [KVCacheGroupSpec(f"{self.method}.{i}", (f"drafter.layers.{i}",),
                                 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize)
                for i, layer in enumerate(self.layers)]

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        for i, layer in enumerate(self.layers):
            layer.kv_cache_group = first_group + i
            layer.kv_cache = torch.zeros(2, num_blocks * block_size, layer.num_kv_heads, layer.head_dim,
                                         dtype=self.dtype, device=self.device)  # [K/V, slots, kv_heads, head_dim]

    def _next_tokens(self, inp: ProposerInput) -> torch.Tensor:
        """[num_tokens]: the token after each layout row (see the module docstring)."""
        qsl = inp.query_start_loc.tolist()
        nxt = torch.zeros_like(inp.input_ids)
        nxt[:-1] = inp.input_ids[1:]
        ends = [(qsl[b + 1] - 1, t) for b, t in enumerate(inp.next_token_ids) if t >= 0]
        if ends:
            rows, tokens = zip(*ends)
            nxt[torch.tensor(rows, device=nxt.device)] = torch.tensor(tokens, dtype=nxt.dtype, device=nxt.device)
        rows, flat = [], []
        width = inp.emitted.shape[1]
        for r, (b, n) in enumerate(zip(inp.sample_rows, inp.num_drafts)):
            first = qsl[b + 1] - 1 - n  # the row of the last committed token
            rows += range(first, first + n + 1)
            flat += range(r * width, r * width + n + 1)
        if rows:
            emitted = inp.emitted.flatten()[torch.tensor(flat, device=nxt.device)].clamp(min=0)
            nxt[torch.tensor(rows, device=nxt.device)] = emitted
        return nxt

    def _forward(self, step: int, input_ids, positions, hidden, batches: dict[int, AttentionBatch]):
        meta = {g: self.backend.build_metadata(batch, self.device) for g, batch in batches.items()}
        with forward_context(ForwardContext(self.backend, meta)):
            return self.drafter(step, input_ids, positions, hidden)

    @torch.inference_mode()
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        dev, bs, drafter = self.device, self.block_size, self.drafter
        qsl, seq_lens = inp.query_start_loc, inp.seq_lens
        q_lens = qsl[1:] - qsl[:-1]
        hidden = inp.aux_hidden_states.flatten(1) if drafter.target_hidden == "aux" else inp.hidden_states
        tables = {layer.kv_cache_group: block_table_tensor([t[layer.kv_cache_group] for t in inp.block_tables])
                  for layer in self.layers}
        batches = {}
        for layer in self.layers:
            table = tables[layer.kv_cache_group]
            _, slots = layout_slots(table, qsl, seq_lens, bs)
            batches[layer.kv_cache_group] = AttentionBatch(qsl, seq_lens, table, slots, bs, int(q_lens.max()),
                                                           int(seq_lens.max()), layer.sliding_window)
        next_ids = self._next_tokens(inp)
        for step in range(drafter.num_step_layers):  # draft prefill: every step layer over the layout
            out = self._forward(step, next_ids, inp.positions, hidden, batches)
            if step == 0:
                logits_hidden, feedback = out
        num_rows = len(inp.sample_rows)
        if num_rows == 0:
            return ProposerOutput(torch.zeros(0, self.k, dtype=torch.int64, device=dev),
                                  torch.zeros(0, dtype=torch.int64, device=dev))
        committed = torch.tensor([int(qsl[b + 1]) - 1 - n for b, n in zip(inp.sample_rows, inp.num_drafts)])
        rows = committed.to(dev) + inp.num_emitted - 1  # [R] row of the last emitted token's predecessor
        logits_hidden, feedback = logits_hidden[rows], feedback[rows]
        history = torch.tensor([len(t) for t in inp.token_ids], dtype=torch.int64, device=dev)
        first_draft_pos = history + inp.num_emitted  # [R] sequence position of draft 0
        sampler = DraftSampler(inp, self.verification, dev)
        x = sampler.sample(drafter.compute_logits(0, logits_hidden), first_draft_pos)
        drafts = [x]
        pos = first_draft_pos - 2  # [R] the drafter position of that row
        tables = {g: t[inp.sample_rows].to(dev) for g, t in tables.items()}
        max_seq = max(len(t) for t in inp.token_ids) + inp.emitted.shape[1] + self.k
        one = torch.arange(num_rows + 1, device=dev)
        saved = None if drafter.advances_positions else self._entries(tables, pos)
        for j in range(1, self.k):
            if drafter.advances_positions:
                pos = pos + 1
            batches = {}
            for layer in self.layers:
                g, table = layer.kv_cache_group, tables[layer.kv_cache_group]
                slots = table.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
                batches[g] = AttentionBatch(one, pos + 1, table, slots, bs, 1, max_seq, layer.sliding_window)
            logits_hidden, feedback = self._forward(j, x, pos, feedback, batches)
            x = sampler.sample(drafter.compute_logits(j, logits_hidden), first_draft_pos + j)
            drafts.append(x)
        if saved is not None:
            for layer, (slots, entries) in zip(self.layers, saved):
                layer.kv_cache[:, slots] = entries
        return ProposerOutput(torch.stack(drafts, dim=1), torch.full((num_rows,), self.k, device=dev),
                              sampler.draft_probs())

    def _entries(self, tables: dict[int, torch.Tensor], pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of each layer's cache entries at ``pos`` (decode steps that stay put overwrite them)."""
        out = []
        for layer in self.layers:
            table = tables[layer.kv_cache_group]
            slots = table.gather(1, (pos // self.block_size)[:, None]).squeeze(1) * self.block_size \
                + pos % self.block_size
            out.append((slots, layer.kv_cache[:, slots].clone()))
        return out


def speculators_redirect(folder: Path) -> tuple[str, dict] | None:
    """A speculators-format drafter folder given as the model: (its verifier, the speculative_config).

    Returns None for any other folder. The checkpoint's ``speculative_tokens`` becomes k.
    """
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    hf = json.loads(config_file.read_text())
    if "speculators_model_type" not in hf:
        return None
    verifier = hf.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    if not verifier:
        raise ValueError(f"model: {folder} is a speculators drafter without speculators_config.verifier.name_or_path; "
                         f"pass the target as model and this folder as speculative_config.model")
    return verifier, {"method": hf["speculators_model_type"], "model": str(folder)}


class EagleSpeculator(HiddenStateSpeculator):
    method = "eagle"


class Eagle3Speculator(HiddenStateSpeculator):
    method = "eagle3"


class MtpSpeculator(HiddenStateSpeculator):
    method = "mtp"
