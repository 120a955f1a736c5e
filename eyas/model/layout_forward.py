"""A forward over a batch laid out back to back: from a CUDA graph on the uniform padded layout where the batch fits
one (``eyas.model.cuda_graphs``), else eagerly on the flat layout. The runner's target forward, a draft model's
forwards and the EAGLE/MTP speculator's prefill, decode and mask-row forwards are all this one path.

What runs inside is a *step function* ``fn(input_ids [T], positions [T], *extras [T, ...]) -> tuple of [T, ...]``
(the target's layers, a drafter's step layer, ...), called inside a forward context whose attention metadata covers
every KV-cache group the step's layers read. ``extras`` are per-row inputs (a drafter's hidden states) that move with
the tokens between layouts.

Example (k = 3, graphs on): two requests verifying 3 and 1 drafts, query_start_loc [0, 4, 6], fit the uniform
layout of width k + 1 = 4 padded to 2 requests: rows 0..3 and 4..5 hold the tokens, rows 6..7 padding. The graph of
key (label, 2, 4, blocks) replays, and its outputs come back in the flat order, [6, ...].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eyas.model.attention import AttentionBatch, UniformBatch, layout_slots
from eyas.model.cuda_graphs import StepGraphs, UniformLayout, pad_table, table_width
from eyas.model.forward_context import ForwardContext, forward_context

StepFn = Callable[..., tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class CacheGroup:
    """A KV-cache group the step's layers read: its index, and its layers' sliding window (None = full)."""

    index: int
    sliding_window: int | None = None


def model_step(model, num_layers: int | None = None) -> StepFn:
    """A target model as a step function -> (hidden,) or (hidden, aux hidden); ``num_layers``: its first layers
    only (self-speculation), None = all."""

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = model(input_ids, positions, num_layers=num_layers)
        return (out.hidden,) if out.aux_hidden is None else (out.hidden, out.aux_hidden)

    return step


class LayoutForward:
    def __init__(self, backend, graphs: StepGraphs | None, groups: Sequence[CacheGroup], block_size: int,
                 max_blocks: int, device: torch.device):
        self.backend, self.graphs = backend, graphs
        self.groups = list(groups)  # one block table per group in every call; set again when a cache is bound
        self.block_size, self.max_blocks, self.device = block_size, max_blocks, device

    def __call__(self, label: str, fn: StepFn, input_ids: torch.Tensor, positions: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tables: Sequence[torch.Tensor], k: int,
                 extras: Sequence[torch.Tensor] = (), slot_mapping: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, ...]:
        """``fn`` over a flat batch -> its outputs over the flat rows.

        input_ids, positions, extras [T, ...] (device); query_start_loc [B+1], seq_lens [B] (host); ``tables``: a
        block table [B, W] (host) per group; ``k``: the most drafts a query carries (uniform rows are 1 for plain
        decodes, else k + 1); slot_mapping [T] (host): the first group's, when the caller has it already."""
        starts = query_start_loc.tolist()
        max_q = max(b - a for a, b in zip(starts, starts[1:]))
        shape = self.graphs.uniform_shape(len(seq_lens), max_q, k) if self.graphs is not None else None
        if shape is not None:
            width, size = shape
            layout = UniformLayout.of(query_start_loc, seq_lens, tables[0], width, size, self.max_blocks, self.device)
            blocks = layout.block_table.shape[1]
            tables_in = [layout.block_table] + [pad_table(t, size, blocks).to(self.device) for t in tables[1:]]
            outs = self.step(label, fn, layout.scatter(input_ids), layout.scatter(positions), layout.q_lens,
                             layout.seq_lens, tables_in, [layout.scatter(x) for x in extras])
            return tuple(layout.gather(x) for x in outs)
        meta = {}
        for i, (group, table) in enumerate(zip(self.groups, tables, strict=True)):
            slots = slot_mapping if i == 0 and slot_mapping is not None else \
                layout_slots(table, query_start_loc, seq_lens, self.block_size)[1]
            batch = AttentionBatch(query_start_loc, seq_lens, table, slots, self.block_size, max_q,
                                   max(seq_lens.tolist()), group.sliding_window)
            meta[group.index] = self.backend.build_metadata(batch, self.device)
        with forward_context(ForwardContext(self.backend, meta)):
            return fn(input_ids, positions, *extras)

    def step(self, label: str, fn: StepFn, input_ids: torch.Tensor, positions: torch.Tensor, q_lens: torch.Tensor,
             seq_lens: torch.Tensor, tables: Sequence[torch.Tensor], extras: Sequence[torch.Tensor] = ()
             ) -> tuple[torch.Tensor, ...]:
        """``fn`` over a uniform layout (every tensor on the device): request b owns rows ``b * width ..`` with
        width = len(input_ids) // len(q_lens); ``tables`` [size, blocks] per group. Replayed from the graph of
        (label, size, width, blocks) on CUDA; run eagerly on the CPU."""
        size, num_tables = len(q_lens), len(tables)
        key = (label, size, len(input_ids) // size, tables[0].shape[1])

        def uniform(input_ids, positions, q_lens, seq_lens, *rest):  # capturable: metadata from device tensors
            width = input_ids.shape[0] // q_lens.shape[0]
            meta = {group.index: self.backend.build_uniform_metadata(
                        UniformBatch(q_lens, seq_lens, table, self.block_size, width, group.sliding_window))
                    for group, table in zip(self.groups, rest[:num_tables], strict=True)}
            with forward_context(ForwardContext(self.backend, meta)):
                return fn(input_ids, positions, *rest[num_tables:])

        inputs = (input_ids, positions, q_lens, seq_lens, *tables, *extras)
        return self.graphs.run(key, uniform, *inputs) if self.graphs is not None else uniform(*inputs)

    def padded(self, num_rows: int, table_cols: int) -> tuple[int, int]:
        """(rows, block-table columns) a uniform step of ``num_rows`` requests is padded to: up the graphs' ladder
        and to ``table_width`` with graphs, exact without."""
        if self.graphs is None:
            return num_rows, table_cols
        return self.graphs.padded_batch_size(num_rows) or num_rows, table_width(table_cols, self.max_blocks)
