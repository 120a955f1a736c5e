"""A model's forward over a batch laid out back to back, for the layers of one KV-cache group: from a CUDA graph on
the uniform padded layout where the batch fits one (``eyas.model.cuda_graphs``), else eagerly on the flat layout.
The runner's target forward and a draft model's forwards are this one path."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from eyas.model.attention import AttentionBatch, UniformBatch, layout_slots
from eyas.model.cuda_graphs import StepGraphs, UniformLayout
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.model.llama import ModelOutput


class LayoutForward:
    def __init__(self, model, backend, graphs: StepGraphs | None, group: int, block_size: int, max_blocks: int,
                 device: torch.device, num_layers: int | None = None, name: str = "target"):
        self.model, self.backend, self.graphs = model, backend, graphs
        self.group = group  # the KV-cache group whose attention metadata the layers read
        self.block_size, self.max_blocks, self.device = block_size, max_blocks, device
        self.num_layers = num_layers  # run the model's first layers only (self-speculation); None = all
        self.name = name  # part of every graph key, so two users of one StepGraphs never share a graph

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, k: int,
                 slot_mapping: torch.Tensor | None = None) -> ModelOutput:
        """input_ids, positions [T] (device); query_start_loc [B+1], seq_lens [B], block_table [B, W] (host);
        ``k``: the most drafts a query carries (uniform rows are 1 for plain decodes, else k + 1); slot_mapping
        [T] (host) when the caller has it already."""
        max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        shape = self.graphs.uniform_shape(len(seq_lens), max_q, k) if self.graphs is not None else None
        if shape is not None:
            width, size = shape
            layout = UniformLayout.of(query_start_loc, seq_lens, block_table, width, size, self.max_blocks,
                                      self.device)
            states = self.step((self.name, size, width, layout.block_table.shape[1]), layout.scatter(input_ids),
                               layout.scatter(positions), layout.q_lens, layout.seq_lens, layout.block_table)
            return ModelOutput(layout.gather(states[0]), layout.gather(states[1]) if len(states) > 1 else None)
        if slot_mapping is None:
            _, slot_mapping = layout_slots(block_table, query_start_loc, seq_lens, self.block_size)
        batch = AttentionBatch(query_start_loc, seq_lens, block_table, slot_mapping, self.block_size, max_q,
                               int(seq_lens.max()))
        with forward_context(ForwardContext(self.backend, {self.group: self.backend.build_metadata(batch, self.device)})):
            return self.model(input_ids, positions, num_layers=self.num_layers)

    def step(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``uniform_step(*inputs)``, replayed from the graph of ``key`` on CUDA."""
        return self.graphs.run(key, self.uniform_step, *inputs) if self.graphs is not None else self.uniform_step(*inputs)

    def uniform_step(self, input_ids, positions, q_lens, seq_lens, block_table) -> tuple[torch.Tensor, ...]:
        """The forward over a uniform layout, metadata built from device tensors (capturable) -> (hidden[, aux])."""
        width = input_ids.shape[0] // q_lens.shape[0]
        meta = self.backend.build_uniform_metadata(UniformBatch(q_lens, seq_lens, block_table, self.block_size, width))
        with forward_context(ForwardContext(self.backend, {self.group: meta})):
            out = self.model(input_ids, positions, num_layers=self.num_layers)
        return (out.hidden,) if out.aux_hidden is None else (out.hidden, out.aux_hidden)
