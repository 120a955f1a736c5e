"""The proposer interface: one input dataclass in, one output dataclass out; proposers are picked by name from
``eyas.spec_decode.registry``.

A proposer never reaches into the scheduler or the runner. The runner calls ``propose``
once per step, after verification, for the requests that sampled this step, and then walks the drafts of
requests with a grammar (``eyas.spec_decode.grammar_drafts``), for every method alike.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from eyas.core.step import DoneRequest
from eyas.model.attention.base import request_slots
from eyas.spec_decode.adaptive import NO_DRAFT_COST, DraftCost, RowCost
from eyas.spec_decode.options import MethodOptions


@dataclass
class ProposerInput:
    """Everything any proposer may need. Rows r = 0..R-1 are the requests that sampled this step.

    The target's verification forward laid out all B scheduled requests back to back: request b
    owns tokens ``query_start_loc[b]:query_start_loc[b+1]`` (a prompt chunk, or its last token
    followed by its drafts); ``sample_rows[r]`` is the b of row r. Partial prefill chunks are in
    the layout too, so a drafter with its own KV cache can keep it in step with the target.
    """

    request_ids: list[str]  # [R] for proposers that keep per-request state between steps (see request_done)
    token_ids: list[list[int]]  # [R] host: committed history (prompt + outputs), emitted tokens NOT included
    emitted: torch.Tensor  # [R, k'+1] int64, tokens emitted this step, padded with -1
    num_emitted: torch.Tensor  # [R] int64 (accepted drafts + 1)
    num_speculative_tokens: int  # k, the number of drafts to propose
    # the verification forward, for drafters that reuse it
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [B+1] host
    seq_lens: torch.Tensor  # [B] host, context length of each request after the verification forward
    sample_rows: list[int]  # [R] index b of each sampling row in the layout
    hidden_states: torch.Tensor | None  # [num_tokens, hidden] target's last (normed) hidden states
    aux_hidden_states: torch.Tensor | None  # [num_tokens, num_aux, hidden]
    block_tables: list[list[list[int]]]  # [B][group] host block tables (the scheduler's, read-only)
    next_token_ids: list[int]  # [B] host: the committed token after a non-sampling chunk; -1 for sampling requests
    num_drafts: list[int]  # [R] host: drafts verified this step (the last num_drafts[r] tokens of row r's layout)
    # [R] host: drafts the scheduler expects to verify for row r next step (``Scheduler._expected_drafts``); 0 =
    # whatever row r drafts would be dropped, so a proposer may skip it (returning num_drafts 0 for it); cheap
    # proposers may ignore it. Always k without adaptive drafting.
    expected_drafts: list[int]
    # sampling: draft j of row r is verified at sequence index len(token_ids[r]) + num_emitted[r] + j
    seeds: torch.Tensor  # [R] int64
    sampling_params: list[Any]  # [R] SamplingParams
    # [R] eyas.sampling.grammar.GrammarState of each row's committed output, None without a grammar
    # (empty: no row has one); read by ``Proposer.draft``, not by ``propose``
    grammars: list[Any] = field(default_factory=list)

    def slots_in(self, group: int, block_size: int) -> list[int]:
        """[T] the cache slot of each layout row in KV-cache group ``group`` (a proposer's own cache-only layer)."""
        qsl, seq_lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        return [slot for b, seq_len in enumerate(seq_lens)
                for slot in request_slots(self.block_tables[b][group], range(seq_len - qsl[b + 1] + qsl[b], seq_len),
                                          block_size)]

    def rows(self, keep: list[int]) -> "ProposerInput":
        """This input for the sampling rows ``keep`` only (in that order); the layout fields stay whole."""
        index = torch.tensor(keep, dtype=torch.int64, device=self.emitted.device)

        def pick(values: list) -> list:
            return [values[r] for r in keep]

        return dataclasses.replace(
            self, request_ids=pick(self.request_ids), token_ids=pick(self.token_ids), emitted=self.emitted[index],
            num_emitted=self.num_emitted[index], sample_rows=pick(self.sample_rows), num_drafts=pick(self.num_drafts),
            expected_drafts=pick(self.expected_drafts), seeds=self.seeds[index.to(self.seeds.device)],
            sampling_params=pick(self.sampling_params), grammars=pick(self.grammars) if self.grammars else [])


@dataclass
class ProposerOutput:
    draft_token_ids: torch.Tensor  # [R, k] int64; only the first num_drafts[r] of row r count
    num_drafts: torch.Tensor  # [R] int64 (0 = no speculation for this request this step)
    draft_probs: torch.Tensor | None = None  # [R, k, vocab] float32, for rejection sampling; None = one-hot
    forced: torch.Tensor | None = None  # [R, k] bool: the draft is the only token its grammar admits there


class Proposer(ABC):
    """A drafting method. Class attributes declare what it needs from the engine."""

    method: ClassVar[str]
    Options: ClassVar[type[MethodOptions]] = MethodOptions  # its keys of speculative_config (eyas.spec_decode.options)
    needs_hidden_states: ClassVar[bool] = False  # target's last hidden states of the verification forward
    aux_layer_ids: tuple[int, ...] = ()  # target aux layers it reads (vLLM convention); set before the first step

    @classmethod
    def validate_config(cls, config) -> None:
        """Checks that need more than the method's options (``Options.validate`` checks those), on the whole
        SpeculativeConfig; raise ValueError naming the field."""

    @classmethod
    def default_num_speculative_tokens(cls, config: dict) -> int | None:
        """k when the user gives none (a checkpoint may name it), from the raw speculative_config dict."""
        return None

    def step_cost(self, device_type: str, products: Callable[[torch.nn.Module], RowCost]) -> DraftCost:
        """What this proposer's work costs in a step in which some requests draft, in one-row target forwards, where
        it leaves out the rows told 0 (``ProposerInput.expected_drafts``): the cost model charges it to the steps
        that verify drafts (``eyas.spec_decode.adaptive.DraftCost``). ``products(module)``: a module's matrix
        products by rows, in one-row passes of the target's, measured on this CPU (call it on a CPU only).
        ``NO_DRAFT_COST``: drafting is cheap, or it runs whatever it is told. ``SpeculativeConfig.draft_step_cost``
        overrides it."""
        return NO_DRAFT_COST

    def kv_cache_groups(self) -> list:
        """Extra KV-cache groups (eyas.kv.manager.KVCacheGroupSpec) this proposer's layers need."""
        return []

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        """Allocate and bind caches for the groups above; ``first_group`` is the index of the first."""

    @abstractmethod
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        ...

    def request_done(self, done: DoneRequest) -> str | None:
        """A request left the engine for good, whether or not it ever reached ``propose``: drop its state. With
        ``done.block_tables`` its blocks still hold its states until the next forward, to save from. Returns what
        the proposer saved for the request (a file path) or None."""
        return None

    def flush(self) -> None:
        """Wait until everything handed to background work is done; raise its first error."""

    def close(self) -> None:
        """The engine shuts down: persist what should outlive it. No ``propose`` follows; a second call is a no-op."""
