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
   position where it will be verified (``eyas.spec_decode.draft_sampling``).
3. **Draft decode**: k-1 single-token steps fed with the previous draft and the previous step's
   feedback hidden state, using step layer ``j % num_step_layers``. Positions advance one per
   step unless the drafter declares otherwise; a drafter whose positions stay put overwrites its
   entry at the last position, which is restored afterwards, so later steps see the prefill's.
   Where the scheduler expects to verify fewer than k drafts of every request this step drafts for
   (``ProposerInput.expected_drafts``), the chain stops at the most it expects: each pass costs (``DraftCost``).

   A parallel drafter (``Drafter.parallel_depths`` > 0, ``parallel_drafting: true``) instead runs ONE
   forward of k-1 mask rows (as few) per request at the positions after the first draft's row (P-EAGLE), on the
   same uniform padded layout and CUDA graphs as the decode steps.

Example (EAGLE-3, k = 3): history x0..x4, layout [x4, d5, d6] at positions 4..6, verification
accepted d5 and emitted [x5 = d5, x6]. Prefill rows 4, 5, 6 get tokens [x5, x6, junk] with aux
states of positions 4..6; row 5 (x6 with the state at 5) drafts x7 at position 7; decode steps
at positions 6 and 7 draft x8 and x9; a parallel drafter's one forward of mask rows at positions 6 and 7
drafts them instead.

With adaptive drafting, a request the scheduler expects to verify no drafts of next step
(``ProposerInput.expected_drafts`` 0), and a prompt chunk that does not sample, is left out of all three; the
positions it skipped are caught up by the prefill of the step it drafts (``eyas.spec_decode.catch_up``): the
prefill runs over a ``DraftBatch``, the layout's requests that draft, each query extended back over its positions
without drafter entries.

No device-to-host sync: row indices come from host-side layout sizes plus the device-side
number of emitted tokens; host-side sizes are only upper bounds for attention metadata.

**CUDA graphs** (CUDA, unless ``enforce_eager``): all three forwards run through one
``eyas.model.layout_forward.LayoutForward`` over the drafter's KV-cache groups (one per step layer). Draft decode
steps and the mask rows run on rows padded to a batch-size ladder (padding rows write the null block), with block
tables padded to a power of two of blocks, and metadata built inside the step from device tensors; each (forward,
batch, rows per request, table width) is captured once (``eyas.model.cuda_graphs``) and replayed. The draft prefill is
graphed too when every query fits k+1 rows (decodes and verifications, no prompt chunk): request b's tokens move to
rows ``b * (k+1) ..`` and its states come back in the flat order. Batches with prompt chunks or catch-up rows take the
flat eager prefill. On the CPU the decode steps run the same padded-row code eagerly without padding.

Prefix caching shares the drafter's blocks with the target's. A drafter entry at position ``t``
depends on token ``t + 1``, so the last entry of a shared block was computed with the token that
followed it in the request that filled it; a request that shares the block but continues
differently drafts from that one stale entry until it falls out of view. Outputs are unaffected
(verification is lossless); only acceptance can dip on such requests.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from eyas.config import EngineConfig
from eyas.drafters import shipped_drafter
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.attention import block_table_tensor, default_backend, get_backend
from eyas.model.cuda_graphs import engine_graphs, pad_table
from eyas.model.drafters.checkpoint import load_drafter
from eyas.model.host_memory import cache_zeros
from eyas.model.layout_forward import CacheGroup, LayoutForward
from eyas.spec_decode.adaptive import NO_DRAFT_COST, DraftCost, RowCost
from eyas.spec_decode.catch_up import CatchUp, DraftBatch
from eyas.spec_decode.draft_sampling import DraftSampler
from eyas.spec_decode.options import MethodOptions, option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput


@dataclass(frozen=True)
class SpeculatorOptions(MethodOptions):
    model: str | None = option(None, "eagle, eagle3, mtp: the drafter's checkpoint folder; draft_model: a smaller model "
                               "with the target's vocabulary (HF folder or .gguf)", flag="--spec-model", parse=str)


class HiddenStateSpeculator(Proposer):
    Options = SpeculatorOptions
    method: ClassVar[str]
    # where the drafter comes from without speculative_config.model: "none" (required), "target" (MTP layers
    # inside the target's own folder), "shipped" (the drafter eyas ships for the target, eyas.drafters)
    default_drafter: ClassVar[str] = "none"

    @classmethod
    def validate_config(cls, config) -> None:
        if config.options.model is None and cls.default_drafter == "none":
            raise ValueError(f"speculative_config.model: method '{cls.method}' needs the drafter checkpoint folder")

    @classmethod
    def default_num_speculative_tokens(cls, config: dict) -> int | None:
        """A checkpoint may name its k: speculators' ``proposal_methods[0].speculative_tokens``, or eyas's
        top-level ``num_speculative_tokens`` (what ``eyas train`` measured as fastest)."""
        shipped = shipped_drafter(cls.method, parallel=bool(config.get("parallel_drafting")))
        folder = config.get("model") or (shipped if cls.default_drafter == "shipped" else None)
        config_file = Path(folder or "") / "config.json"
        if not folder or not config_file.is_file():
            return None
        hf = json.loads(config_file.read_text())
        methods = hf.get("speculators_config", {}).get("proposal_methods") or [{}]
        return methods[0].get("speculative_tokens") or hf.get("num_speculative_tokens")

    def __init__(self, spec, config: EngineConfig, target):
        self.parallel = getattr(spec.options, "parallel_drafting", False)
        path = spec.options.model if spec.options.model is not None else self._default_path(config.model)
        # a target on eyas's CPU kernels (quantized weights): the drafter's matrices become Q8_0 blocks
        precision = config.matmul_precision if config.quantization is not None else None
        self.drafter = load_drafter(path, target, dtype=config.dtype, device=config.device,
                                    max_positions=config.max_positions, method=self.method, matmul_precision=precision)
        self._check_parallel(spec.num_speculative_tokens)
        self.aux_layer_ids = self.drafter.aux_layer_ids
        self.needs_hidden_states = self.drafter.target_hidden == "last"
        self.k = spec.num_speculative_tokens
        self.verification = spec.verification
        self.device, self.dtype = config.device, config.dtype
        self.block_size = config.cache.block_size
        # the target's default: the C kernel on a CPU, sdpa on CUDA (its uniform-layout metadata is built from
        # device tensors, in CUDA graphs)
        backend = get_backend(default_backend(config.device))
        self.layers = self.drafter.attention_layers()
        # the prefill, decode and mask-row forwards; its groups (one per step layer) are set by bind_kv_caches
        self.layout_forward = LayoutForward(backend, engine_graphs(config, backend), [], self.block_size,
                                            config.max_blocks_per_request, self.device)
        # only adaptive drafting tells a request 0 (``eyas.spec_decode.adaptive``); the store costs memory
        # (eyas.spec_decode.catch_up)
        width = config.model.hidden_size * (len(self.aux_layer_ids) if self.drafter.target_hidden == "aux" else 1)
        self.catch_up = CatchUp(width, self.block_size, self.dtype, self.device) if spec.adaptive_draft_length else None

    def _default_path(self, target) -> Path:
        if self.default_drafter == "target":
            return target.path  # MTP layers inside the target's checkpoint
        path = shipped_drafter(self.method, target, self.parallel)
        if path is None and self.parallel:
            raise ValueError(f"speculative_config.model: eyas ships no parallel {self.method} drafter for the target "
                             f"{target.path.name} (docs/parallel_drafting.md); give a drafter folder, or train one "
                             f"with `eyas train {self.method} --parallel-drafting`")
        if path is None:
            raise ValueError(f"speculative_config.model: eyas ships no {self.method} drafter for the target "
                             f"{target.path.name} (only for the default model, SmolLM2-135M-Instruct); give a drafter "
                             f"folder, or train one with `eyas train {self.method}`")
        return path

    def _check_parallel(self, k: int) -> None:
        """A parallel drafter runs only as one (``parallel_drafting``), and drafts at most its trained depths."""
        depths, config_file = self.drafter.parallel_depths, self.drafter.spec.config_file
        if self.parallel != bool(depths):
            raise ValueError(f"speculative_config.parallel_drafting: {self.parallel}, but {config_file} is a "
                             f"{'parallel (P-EAGLE)' if depths else 'chain'} drafter; set parallel_drafting: "
                             f"{bool(depths)}")
        if depths and k > depths:
            raise ValueError(f"speculative_config.num_speculative_tokens: {k} exceeds the {depths} depths the parallel "
                             f"drafter was trained for (parallel_drafting_depths in {config_file})")

    def step_cost(self, device_type: str, products: Callable[[torch.nn.Module], RowCost]) -> DraftCost:
        """On a CPU: at one request, what leaving every request out of a step saves, in one-row products of the
        target (the unit of ``RowCost``; a left-out request's rows are caught up later, ``eyas.spec_decode.catch_up``,
        and a step that drafts for nobody still stores its inputs): a fixed part and one per drafter pass, timed
        for the shipped EAGLE-3 drafter at batch 1 (``bench_drafters.py``'s "per step" at k = 1 and k = 3, every
        draft verified, less the 0.3 ms the proposer takes in a step that drafts for nobody, over the target's
        one-row products): 1.72 and 3.46 ms beside 4.86 ms on a Zen 4 thread, so a pass 0.18 and the rest 0.11 (with
        0.18 for the rest too, EAGLE-3 never drafted on chat prompts and ran at 0.96x, against 0.98-1.00x with 0.11);
        a chain of d drafts runs d passes, more requests add what the drafter's products, measured on
        this CPU, grow by (``DraftCost``), and a request left out costs, when it drafts again, the products of its
        catch-up. An MTP step runs the target's whole head and costs about 1.35x as much, so for MTP the figure is
        low. On CUDA its graphs make it small: 0."""
        if device_type != "cpu":
            return NO_DRAFT_COST
        return DraftCost(base=0.18, fixed=0.11, products=products(self.drafter),
                         parallel=bool(self.drafter.parallel_depths), catches_up=self.catch_up is not None)

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        groups = [KVCacheGroupSpec(f"{self.method}.{i}", (f"drafter.layers.{i}",),
                                   2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize)
                  for i, layer in enumerate(self.layers)]
        return groups + ([self.catch_up.kv_cache_group(f"{self.method}.store")] if self.catch_up else [])

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        for i, layer in enumerate(self.layers):
            layer.kv_cache_group = first_group + i
            layer.kv_cache = cache_zeros((2, num_blocks * block_size, layer.num_kv_heads, layer.head_dim), self.dtype,
                                    self.device)  # [K/V, slots, kv_heads, head_dim]
        self.layout_forward.groups = [CacheGroup(layer.kv_cache_group, layer.sliding_window) for layer in self.layers]
        if self.catch_up:
            self.catch_up.bind_kv_cache(num_blocks * block_size, first_group + len(self.layers))

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

    @torch.inference_mode()
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        dev, num_rows = self.device, len(inp.sample_rows)
        hidden = inp.aux_hidden_states.flatten(1) if self.drafter.target_hidden == "aux" else inp.hidden_states
        next_ids = functools.partial(self._next_tokens, inp)  # built only for a step that drafts
        batch = (self.catch_up.batch(inp, next_ids, hidden) if self.catch_up
                 else DraftBatch.of_layout(inp, next_ids(), hidden))
        drafting = [r for r, n in enumerate(inp.expected_drafts) if n > 0]  # the other rows get no drafts
        out = ProposerOutput(torch.zeros(num_rows, self.k, dtype=torch.int64, device=dev),
                             torch.zeros(num_rows, dtype=torch.int64, device=dev))
        if batch is None:
            return out
        tables = [block_table_tensor([inp.block_tables[b][layer.kv_cache_group] for b in batch.requests])
                  for layer in self.layers]  # [B', blocks] per step layer
        # the draft prefill: every step layer over the batch's rows; step 0's states
        logits_hidden, feedback = self.layout_forward("prefill", self._prefill_step, batch.input_ids, batch.positions,
                                                      batch.query_start_loc, batch.seq_lens, tables, self.k,
                                                      [batch.hidden])
        if not drafting:
            return out
        sub = inp.rows(drafting) if len(drafting) < num_rows else inp
        slot = {b: i for i, b in enumerate(batch.requests)}
        index = torch.tensor([slot[b] for b in sub.sample_rows])  # [R'] each drafting row's request in the batch
        # as deep as the scheduler expects to verify: each draft past the first is a pass (DraftCost)
        depth = min(self.k, max(inp.expected_drafts[r] for r in drafting))
        drafts, probs = self._chain(sub, logits_hidden, feedback, batch.query_start_loc[1:][index],
                                    [t[index] for t in tables], depth)  # [R', depth], [R', depth, V] or None
        if len(drafting) == num_rows and depth == self.k:  # every row, every draft: nothing to scatter
            return ProposerOutput(drafts, out.num_drafts.fill_(depth), probs)
        rows = torch.tensor(drafting, device=dev)
        out.draft_token_ids[rows, :depth], out.num_drafts[rows] = drafts, depth
        if probs is not None:
            out.draft_probs = probs.new_zeros(num_rows, self.k, probs.shape[-1])
            out.draft_probs[rows, :depth] = probs
        return out

    def _chain(self, inp: ProposerInput, logits_hidden: torch.Tensor, feedback: torch.Tensor, row_end: torch.Tensor,
               tables: list[torch.Tensor], depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``depth`` (<= k) drafts of every row of ``inp`` -> (tokens [R, depth], draft probabilities
        [R, depth, V] or None).

        ``row_end`` [R] (host): the end of each row's prefill query; ``tables`` [R, blocks] per step layer."""
        dev, drafter = self.device, self.drafter
        # row of each request's last committed token, then of the last emitted token's predecessor
        committed = row_end - 1 - torch.tensor(inp.num_drafts, dtype=torch.int64)
        rows = committed.to(dev) + inp.num_emitted - 1  # [R]
        logits_hidden, feedback = logits_hidden[rows], feedback[rows]
        history = torch.tensor([len(t) for t in inp.token_ids], dtype=torch.int64, device=dev)
        first_draft_pos = history + inp.num_emitted  # [R] sequence position of draft 0
        sampler = DraftSampler(inp, self.verification, dev)
        x = sampler.sample(drafter.compute_logits(0, logits_hidden), first_draft_pos)
        drafts = [x]
        pos = first_draft_pos - 2  # [R] the drafter position of that row
        tables = [t.to(dev) for t in tables]
        if drafter.parallel_depths:
            drafts += self._parallel(sampler, pos, first_draft_pos, tables, depth)
        else:
            drafts += self._decode(sampler, x, feedback, pos, first_draft_pos, tables, depth)
        return torch.stack(drafts, dim=1), sampler.draft_probs()

    def _decode(self, sampler: DraftSampler, x: torch.Tensor, feedback: torch.Tensor, pos: torch.Tensor,
                first_draft_pos: torch.Tensor, tables: list[torch.Tensor], depth: int) -> list[torch.Tensor]:
        """Drafts 2..depth of a chain drafter: depth-1 single-token steps, each fed the previous draft and
        feedback."""
        drafter, dev, num_rows = self.drafter, self.device, len(x)
        saved = None if drafter.advances_positions else self._entries(tables, pos)
        # draft decode over rows padded to the graph's batch size (padding rows write the null block)
        size, blocks = self.layout_forward.padded(num_rows, tables[0].shape[1])
        x_in = torch.zeros(size, dtype=torch.int64, device=dev)
        pos_in = torch.zeros(size, dtype=torch.int64, device=dev)
        ones = torch.ones(size, dtype=torch.int64, device=dev)
        feedback_in = feedback.new_zeros(size, feedback.shape[1])
        tables_in = [pad_table(t, size, blocks) for t in tables]
        drafts = []
        for j in range(1, depth):
            if drafter.advances_positions:
                pos = pos + 1
            x_in[:num_rows], pos_in[:num_rows], feedback_in[:num_rows] = x, pos, feedback
            # steps 1..k-1 differ only in their step layer j % num_step_layers, so those share a graph
            fn = functools.partial(self._draft_step, j)
            logits, feedback = self.layout_forward.step(f"decode.{j % drafter.num_step_layers}", fn, x_in, pos_in,
                                                        ones, pos_in + 1, tables_in, [feedback_in])
            feedback = feedback[:num_rows]
            x = sampler.sample(logits[:num_rows], first_draft_pos + j)
            drafts.append(x)
        if saved is not None:
            for layer, (slots, entries) in zip(self.layers, saved):
                layer.kv_cache[:, slots] = entries
        return drafts

    def _parallel(self, sampler: DraftSampler, anchor: torch.Tensor, first_draft_pos: torch.Tensor,
                  tables: list[torch.Tensor], depth: int) -> list[torch.Tensor]:
        """Drafts 2..depth of a parallel drafter: one forward of depth-1 mask rows per request at positions
        ``anchor + 1 .. anchor + depth-1`` (``anchor`` [R]: the position of the row that gave draft 1), on the
        uniform layout padded to the graph's batch size. Depth d's draft is sampled at sequence position
        first_draft_pos + d."""
        num_rows, width, dev = len(anchor), depth - 1, self.device
        if width == 0:
            return []
        size, blocks = self.layout_forward.padded(num_rows, tables[0].shape[1])
        anchor_in = torch.zeros(size, dtype=torch.int64, device=dev)
        anchor_in[:num_rows] = anchor
        positions = (anchor_in[:, None] + torch.arange(1, width + 1, device=dev)).flatten()  # [size * (k-1)]
        input_ids, hidden = self.drafter.mask_inputs(len(positions), dev)
        logits, _ = self.layout_forward.step("parallel", functools.partial(self._draft_step, 0), input_ids, positions,
                                             torch.full_like(anchor_in, width), anchor_in + 1 + width,
                                             [pad_table(t, size, blocks) for t in tables], [hidden])
        logits = logits.view(size, width, -1)[:num_rows]  # [R, k-1, V]
        return [sampler.sample(logits[:, d], first_draft_pos + 1 + d) for d in range(width)]

    def _prefill_step(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every step layer over the rows (each writes its own KV-cache group) -> step 0's (logits hidden,
        feedback)."""
        outs = [self.drafter(step, input_ids, positions, hidden) for step in range(self.drafter.num_step_layers)]
        return outs[0]

    def _draft_step(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step layer ``step`` over the rows -> (float32 logits [T, V], feedback [T, H])."""
        logits_hidden, feedback = self.drafter(step, input_ids, positions, hidden)
        return self.drafter.compute_logits(step, logits_hidden), feedback

    def _entries(self, tables: list[torch.Tensor], pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of each layer's cache entries at ``pos`` (decode steps that stay put overwrite them)."""
        out = []
        for layer, table in zip(self.layers, tables):
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
    if hf["speculators_model_type"] == "peagle":  # vLLM's mapping: EAGLE-3 with parallel drafting
        return verifier, {"method": "eagle3", "parallel_drafting": True, "model": str(folder)}
    return verifier, {"method": hf["speculators_model_type"], "model": str(folder)}


class EagleSpeculator(HiddenStateSpeculator):
    method = "eagle"


@dataclass(frozen=True)
class Eagle3Options(SpeculatorOptions):
    # vLLM's name: a parallel (P-EAGLE) drafter drafts 2..k in one forward of mask rows; without "model" the
    # shipped parallel drafter
    parallel_drafting: bool = option(False, "eagle3: a parallel (P-EAGLE) drafter, drafts 2..k in one forward; "
                                            "without --spec-model the shipped one", flag="--parallel-drafting")

    def validate(self) -> None:
        if not isinstance(self.parallel_drafting, bool):
            raise ValueError(f"speculative_config.parallel_drafting: {self.parallel_drafting!r} must be true or false")


class Eagle3Speculator(HiddenStateSpeculator):
    Options = Eagle3Options
    method = "eagle3"
    default_drafter = "shipped"


class MtpSpeculator(HiddenStateSpeculator):
    method = "mtp"
    default_drafter = "target"
