"""Turns a scheduler plan into tensors, runs the target, verifies drafts, runs the proposer.

The only owner of device tensors. Sampling and verification are one path: a request that
carries no drafts is verified with k = 0, which is plain sampling (the bonus token of an empty
chain is the sampler's own draw at that (seed, position)).

**CUDA graphs** (CUDA, unless ``enforce_eager``, with a backend that builds uniform-layout
metadata): a forward whose every query fits ``width`` rows (1 for plain decodes, k + 1 when
verifying drafts) runs on the uniform layout that ``eyas.model.cuda_graphs`` replays. Request
b's tokens move to rows ``b * width ..``, the batch is padded up the ladder with empty requests,
block tables to ``table_width``; the hidden states are gathered back into the flat layout, so
verification and drafting never see the difference. Batches with longer queries (prompt chunks)
run eagerly on the flat layout.

**Structured output**: the token masks of the verify rows of requests with a grammar are started
on a worker thread before the forward and applied to the logits after it (``eyas.sampling.grammar_masks``):
the target's distribution at every verified position is the grammar-masked, renormalised one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from eyas.config import EngineConfig
from eyas.core.host_ints import host_ints
from eyas.core.step import DoneRequest, RunnerOutput, ScheduledRequest, SchedulerOutput
from eyas.core.verify_layout import VerifyLayout
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import block_table_tensor, default_backend, get_backend, request_slots
from eyas.model.cuda_graphs import engine_graphs
from eyas.model.host_memory import cache_zeros
from eyas.model.layout_forward import CacheGroup, LayoutForward, model_step
from eyas.model.llama import ModelOutput
from eyas.model.loader import load_model
from eyas.runner.prompt_logprobs import prompt_logprobs
from eyas.runner.row_cost import measured_draft_products, measured_row_cost
from eyas.sampling.allowed import restrict
from eyas.sampling.grammar_masks import GrammarMasks, GrammarTimings, MaskFiller, PendingMasks
from eyas.sampling.penalties import penalize
from eyas.sampling.rejection import VerifyResult, greedy_verify, rejection_sample, shared_noise_verify
from eyas.sampling.row_ops import argmax
from eyas.sampling.sampler import Sampler, SamplingBatch, raw_logprobs
from eyas.spec_decode.adaptive import RowCost
from eyas.spec_decode.grammar_drafts import grammar_drafts
from eyas.spec_decode.proposer import ProposerInput, ProposerOutput
from eyas.spec_decode.registry import make_proposer


@dataclass
class _Inputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [B+1] host
    seq_lens: torch.Tensor  # [B] host
    block_table: torch.Tensor  # [B, max_blocks] host, KV-cache group 0
    slot_mapping: torch.Tensor  # [num_tokens] host


class ModelRunner:
    def __init__(self, config: EngineConfig, attention_backend: str | None = None):
        self.config = config
        self.device = config.device
        spec = config.speculative
        self.model = load_model(config.model, config.dtype, config.device, config.max_positions,
                                quantization=config.quantization, matmul_precision=config.matmul_precision)
        self.backend = get_backend(attention_backend or default_backend(config.device))
        self.sampler = Sampler()
        self.block_size = config.cache.block_size
        self.proposer = make_proposer(spec, config, self.model) if spec else None
        if self.proposer is not None:
            self.model.set_aux_layer_ids(self.proposer.aux_layer_ids)
        self.verification = spec.verification if spec else "shared_noise"
        self._grammar_seconds = 0.0  # spent walking drafts under grammars (eyas.spec_decode.grammar_drafts)
        self.target = LayoutForward(self.backend, engine_graphs(config, self.backend), [CacheGroup(0)], self.block_size,
                                    config.max_blocks_per_request, self.device)
        self._target_step = model_step(self.model)
        self.masks = MaskFiller(config.model.vocab_size)

    def measured_row_cost(self) -> RowCost:
        """This CPU's row-cost curve for the target's products and attention, from its record in the cache folder
        (measured and recorded the first time: eyas/runner/row_cost.py)."""
        return measured_row_cost(self.model, self.config.quantization, self.config.matmul_precision,
                                 torch.get_num_threads(), self.config.dtype)

    def measured_draft_products(self, drafter: torch.nn.Module) -> RowCost:
        """A drafter's products by rows, in one-row passes of the target's, on this CPU (recorded like the row cost)."""
        return measured_draft_products(drafter, self.model, self.config.quantization, self.config.matmul_precision,
                                       torch.get_num_threads())

    @property
    def grammar_timings(self) -> GrammarTimings:
        """What structured output cost: masks (and how much of them the forward did not hide), draft walks."""
        return dataclasses.replace(self.masks.timings, draft_seconds=self._grammar_seconds)

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The target's layers form group 0; a proposer may add groups of its own after it."""
        layers = self.model.attention_layers()
        cfg = self.config.model
        per_token = 2 * cfg.num_kv_heads * cfg.head_dim * self.config.dtype.itemsize * len(layers)
        groups = [KVCacheGroupSpec("target", tuple(f"layers.{a.layer_id}" for a in layers), per_token)]
        return groups + (self.proposer.kv_cache_groups() if self.proposer else [])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config.model
        num_slots = num_blocks * self.block_size
        for layer in self.model.attention_layers():
            layer.kv_cache = cache_zeros((2, num_slots, cfg.num_kv_heads, cfg.head_dim), self.config.dtype,
                                    self.device)  # [K/V, slots, kv_heads, head_dim]
        if self.proposer:
            self.proposer.bind_kv_caches(num_blocks, self.block_size, first_group=1)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> tuple[ModelOutput, _Inputs]:
        """Run the target over the plan's tokens (writing their K/V into the cache)."""
        inputs = self._prepare(plan)
        k = self.config.speculative.max_drafts if self.config.speculative else 0
        hidden, *aux = self.target("target", self._target_step, inputs.input_ids, inputs.positions,
                                   inputs.query_start_loc, inputs.seq_lens, [inputs.block_table], k,
                                   slot_mapping=inputs.slot_mapping)
        return ModelOutput(hidden, aux[0] if aux else None), inputs

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        verify = VerifyLayout.of(plan)
        pending = self._start_masks(verify)  # overlaps the forward
        out, inputs = self.forward(plan)
        prompt_lp = prompt_logprobs(self.model.compute_logits, out.hidden, plan.scheduled, inputs.query_start_loc)
        if not verify.entries:
            if self.proposer:  # a drafter with its own cache still sees every prompt chunk
                self._propose(plan, inputs, out, verify, VerifyResult(torch.zeros(0, 1, dtype=torch.int64),
                                                                      torch.zeros(0, dtype=torch.int64)))
            return RunnerOutput({}, {}, {}, {}, prompt_logprobs=prompt_lp)
        # rows are increasing: when every row is verified (decodes, drafts) they are the forward's, in order
        hidden = out.hidden if verify.num_rows == out.hidden.shape[0] else out.hidden[verify.flat_rows.to(self.device)]
        logits = self.model.compute_logits(hidden)  # [N, vocab]
        pad = verify.pad.to(self.device)
        masks = pending.result(self.device) if pending is not None else None
        result = self._verify(verify, logits, pad, masks)
        # drafting is queued before the first device-to-host copy of the verification result
        proposal = self._propose(plan, inputs, out, verify, result) if self.proposer else None
        emitted, counts = result.output_tokens.tolist(), [n + 1 for n in result.num_accepted.tolist()]
        ids = [e.request.request_id for e in verify.entries]
        sampled = {i: emitted[r][:counts[r]] for r, i in enumerate(ids)}
        proposals, forced, probs = self._collect(verify.entries, proposal) if proposal is not None else ({}, {}, {})
        return RunnerOutput(sampled, dict(zip(ids, verify.num_drafts.tolist())),
                            self._logprobs(verify.entries, logits, pad, emitted, counts), proposals, forced,
                            draft_probs=probs, prompt_logprobs=prompt_lp)

    def _start_masks(self, verify: VerifyLayout) -> PendingMasks | None:
        """Start the grammar masks of the sampling requests' verify rows."""
        jobs = [(e.request.grammar, first, e.draft_token_ids)
                for e, first in zip(verify.entries, verify.first.tolist()) if e.request.grammar is not None]
        return self.masks.start(jobs, verify.num_rows)

    def _verify(self, verify: VerifyLayout, logits: torch.Tensor, pad: torch.Tensor,
                masks: GrammarMasks | None) -> VerifyResult:
        """logits [N, vocab] (raw) of the verify positions; pad [R, k+1] their rows per request (on the device)."""
        entries = verify.entries
        drafts, num_drafts = verify.drafts.to(self.device), verify.num_drafts.to(self.device)
        params = [e.request.params for e in entries]
        logits = penalize(logits, [(e.request.params, e.request.token_ids, e.request.num_prompt_tokens,
                                    e.draft_token_ids) for e in entries])
        logits = restrict(logits, [(e.request.params, e.request.eos_token_ids, e.request.num_output_tokens,
                                    len(e.draft_token_ids), e.request.grammar is not None) for e in entries])
        if all(p.greedy for p in params):
            tokens = masks.argmax(logits) if masks is not None else argmax(logits)  # [N]
            return greedy_verify(_by_request(tokens, pad), drafts, num_drafts)
        if masks is not None:
            logits = masks.apply(logits)
        width = pad.shape[1]
        seeds = [e.request.seed for e in entries]
        positions = [[e.request.num_tokens + j for j in range(width)] for e in entries]
        counts = verify.rows_per_request
        batch = SamplingBatch.from_params([p for p, n in zip(params, counts) for _ in range(n)],
                                          [s for s, n in zip(seeds, counts) for _ in range(n)],
                                          [q for row, n in zip(positions, counts) for q in row[:n]], self.device)
        target = self.sampler.processed_logprobs(logits, batch)  # [N, vocab]
        target = _by_request(target, pad)  # [R, k+1, vocab]
        seeds_t = host_ints(seeds).to(self.device)
        positions_t = host_ints(positions, pad.shape).to(self.device)
        if self.verification == "shared_noise" or width == 1:
            return shared_noise_verify(target, drafts, seeds_t, positions_t, num_drafts)
        draft_probs = self._pending_probs(entries, width - 1, target.shape[-1])
        if draft_probs is not None and masks is not None:  # kept drafts were drawn from q restricted to the grammar
            draft_probs = masks.restrict(draft_probs, pad[:, :-1])
        return rejection_sample(target, drafts, draft_probs, seeds_t, positions_t, num_drafts)

    def _pending_probs(self, entries: list[ScheduledRequest], k: int, vocab: int) -> torch.Tensor | None:
        """Draft probabilities of this step's drafts ([R, k, vocab]); None when the proposer gave none."""
        if all(e.draft_probs is None for e in entries):
            return None
        probs = torch.zeros(len(entries), k, vocab, device=self.device)
        for r, e in enumerate(entries):
            n = len(e.draft_token_ids)
            if e.draft_probs is None:  # drafts without probabilities count as one-hot
                probs[r, torch.arange(n), torch.tensor(e.draft_token_ids, dtype=torch.int64)] = 1.0
            else:
                probs[r, :n] = e.draft_probs[:n]
        return probs

    def _propose(self, plan: SchedulerOutput, inputs: _Inputs, out: ModelOutput, verify: VerifyLayout,
                 result: VerifyResult) -> ProposerOutput:
        entries = verify.entries
        inp = ProposerInput(
            request_ids=[e.request.request_id for e in entries],
            token_ids=[e.request.token_ids for e in entries],
            emitted=result.output_tokens,
            num_emitted=result.num_accepted + 1,
            num_speculative_tokens=self.config.speculative.max_drafts,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            sample_rows=verify.sample_rows,
            hidden_states=out.hidden if self.proposer.needs_hidden_states else None,
            aux_hidden_states=out.aux_hidden,
            block_tables=[e.block_tables for e in plan.scheduled],
            next_token_ids=[-1 if e.will_sample else e.request.token_ids[e.start + e.num_new_tokens] for e in plan.scheduled],
            num_drafts=[len(e.draft_token_ids) for e in entries],
            expected_drafts=[plan.expected_drafts[e.request.request_id] for e in entries],
            seeds=host_ints([e.request.seed for e in entries]).to(self.device),
            sampling_params=[e.request.params for e in entries],
            grammars=[e.request.grammar for e in entries],
        )
        out = self.proposer.propose(inp)
        if all(grammar is None for grammar in inp.grammars):
            return out
        start = time.perf_counter()
        # for every method alike: forbidden drafts cut, forced tokens drafted (up to the lookahead, past k)
        out = grammar_drafts(inp, out, self.config.speculative.lookahead)
        self._grammar_seconds += time.perf_counter() - start
        return out

    def _collect(self, entries: list[ScheduledRequest], proposal) -> tuple[dict, dict, dict]:
        """Copy the proposal's drafts and forced flags to the host; draft probabilities stay on the device (for
        rejection mode), each request's in its own slice: ({id: drafts}, {id: forced}, {id: probs})."""
        tokens, counts = proposal.draft_token_ids.tolist(), proposal.num_drafts.tolist()
        flags = proposal.forced.tolist() if proposal.forced is not None else None
        keep_probs = proposal.draft_probs is not None and self.verification == "rejection"
        drafts, forced, probs = {}, {}, {}
        for r, e in enumerate(entries):
            request_id = e.request.request_id
            drafts[request_id] = tokens[r][:counts[r]]
            forced[request_id] = flags[r][:counts[r]] if flags is not None else [False] * counts[r]
            if keep_probs:
                probs[request_id] = proposal.draft_probs[r, :counts[r]]
        return drafts, forced, probs

    def request_done(self, done: DoneRequest) -> str | None:
        """A request left the engine: the proposer drops its state, and may save it first (hidden-state dumps)
        from the blocks, before the next forward reuses them."""
        return self.proposer.request_done(done) if self.proposer else None

    def flush(self) -> None:
        if self.proposer:
            self.proposer.flush()

    def close(self) -> None:
        if self.proposer:
            self.proposer.close()

    def _prepare(self, plan: SchedulerOutput) -> _Inputs:
        """The forward's inputs, built from host ints: a decode step is a handful of them, and each tensor op on
        them costs microseconds (a batch-1 step's layout took about 0.2 ms in tensor and NumPy ops)."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for entry in plan.scheduled:
            request, start, n = entry.request, entry.start, entry.num_new_tokens
            fed = request.token_ids[start:start + n] + entry.draft_token_ids
            end = start + len(fed)  # the request's first position is its first token not in the cache: start
            input_ids += fed
            positions += range(start, end)
            slots += request_slots(entry.block_tables[0], range(start, end), self.block_size)
            query_start_loc.append(query_start_loc[-1] + len(fed))
            seq_lens.append(end)
        return _Inputs(host_ints(input_ids).to(self.device), host_ints(positions).to(self.device),
                       host_ints(query_start_loc), host_ints(seq_lens),
                       block_table_tensor([entry.block_tables[0] for entry in plan.scheduled]), host_ints(slots))

    def _logprobs(self, entries: list[ScheduledRequest], logits: torch.Tensor, pad: torch.Tensor,
                  emitted: list[list[int]], counts: list[int]) -> dict[str, list[dict[int, float]]]:
        """Raw-distribution logprobs (log_softmax of the logits) of each emitted token plus the top-n."""
        wanted = [r for r, e in enumerate(entries) if e.request.params.logprobs is not None]
        if not wanted:
            return {}
        n = max(entries[r].request.params.logprobs for r in wanted)
        width = pad.shape[1]
        tokens = torch.tensor([emitted[r] for r in wanted], device=self.device).clamp(min=0)  # [W, k+1]
        lp = raw_logprobs(logits[pad[wanted].flatten()], tokens.view(-1), n)  # rows W * (k+1)
        token_lp = lp.sampled_logprobs.view(-1, width).tolist()
        top_ids = lp.top_token_ids.view(len(wanted), width, n).tolist()
        top_lp = lp.top_logprobs.view(len(wanted), width, n).tolist()
        out = {}
        for w, r in enumerate(wanted):
            size = entries[r].request.params.logprobs
            per_token = []
            for j in range(counts[r]):
                entry = dict(zip(top_ids[w][j][:size], top_lp[w][j][:size]))
                entry[emitted[r][j]] = token_lp[w][j]
                per_token.append(entry)
            out[entries[r].request.request_id] = per_token
        return out


def _by_request(rows: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """rows [N, ...] of the verify positions -> [R, k+1, ...] by ``pad`` (``VerifyLayout.pad``); a view where every
    request verifies k drafts (N = R (k+1): the rows are laid out in that order already)."""
    return rows.view(*pad.shape, *rows.shape[1:]) if rows.shape[0] == pad.numel() else rows[pad]
