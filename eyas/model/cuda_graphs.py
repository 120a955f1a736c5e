"""CUDA graphs of fixed-shape step functions, captured lazily per key and replayed.

A caller pads its batch to a size of the ladder (``padded_batch_size``) and hands ``run`` a
function whose every input is a device tensor of a shape fixed by the key: attention metadata is
built inside the function from device tensors (``AttentionBackend.build_uniform_metadata``), so
the step reads nothing from the host and has the same kernels at every replay.

The first call with a key warms the function up on a side stream (lazy initialisations, cuBLAS
workspaces), then captures it into a graph; all graphs share one memory pool. Every call copies
its inputs into the graph's own static inputs and replays. The returned outputs are the graph's
static outputs: read them before the same key runs again. Graphs sharing the pool may reuse
each other's intermediate memory, which is safe because replays never overlap and the outputs
of every graph stay referenced (so no other graph allocates over them).

``capture=False`` runs the same padded function eagerly: the CPU path, which lets tests check
the padding and the uniform layout without a GPU.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from eyas.kv.block_pool import NULL_BLOCK

Step = Callable[..., tuple[torch.Tensor, ...]]


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to the first size >= ``max_batch``: at most 8 rows of padding
    past 8 and at most twice the rows below it."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 8)
    return sizes[:bisect_left(sizes, max_batch) + 1]


def table_width(width: int, max_blocks: int) -> int:
    """Block-table columns of a graphed step: the next power of two (at least 4) up to a request's widest
    table, so that a few graphs cover every context length."""
    return min(max(4, 1 << (width - 1).bit_length()), max(max_blocks, width))


def pad_table(table: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[R, W'] block table -> [rows, width], padded with the null block."""
    out = table.new_full((rows, width), NULL_BLOCK)
    out[:table.shape[0], :table.shape[1]] = table
    return out


@dataclass
class UniformLayout:
    """Where a flat back-to-back batch lands on the uniform layout of ``size`` requests of ``width`` rows.

    Request b's tokens ``query_start_loc[b]:query_start_loc[b+1]`` move to rows ``b * width ..``;
    requests ``B .. size - 1`` are padding (q_len 0, seq_len 0, null block table). Example (width 4,
    size 2): one request with q_lens [3] owns rows 0..2; rows 3..7 are padding.
    """

    rows: torch.Tensor  # [T] device: uniform row of each flat token
    q_lens: torch.Tensor  # [size] device
    seq_lens: torch.Tensor  # [size] device
    block_table: torch.Tensor  # [size, blocks] device, blocks = ``table_width`` of the widest table
    width: int
    size: int

    @classmethod
    def of(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, width: int,
           size: int, max_blocks: int, device: torch.device) -> "UniformLayout":
        """From host tensors: query_start_loc [B+1], seq_lens [B], block_table [B, W'] of one KV-cache group."""
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        rows = req * width + torch.arange(len(req)) - query_start_loc[:-1][req]
        q_lens_in = torch.zeros(size, dtype=torch.int64)
        q_lens_in[:len(q_lens)] = q_lens
        seq_lens_in = torch.zeros(size, dtype=torch.int64)
        seq_lens_in[:len(q_lens)] = seq_lens
        table = pad_table(block_table, size, table_width(block_table.shape[1], max_blocks))
        return cls(rows.to(device), q_lens_in.to(device), seq_lens_in.to(device), table.to(device), width, size)

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [size * width, ...], zeros in padding rows."""
        return flat.new_zeros(self.size * self.width, *flat.shape[1:]).index_copy_(0, self.rows, flat)

    def gather(self, uniform: torch.Tensor) -> torch.Tensor:
        """[size * width, ...] -> [T, ...] in the flat order."""
        return uniform.index_select(0, self.rows)


class StepGraphs:
    def __init__(self, device: torch.device, max_batch: int, capture: bool):
        self.device = device
        self.sizes = batch_size_ladder(max_batch)
        self.capture = capture
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple, tuple]] = {}
        self._pool = None

    def padded_batch_size(self, n: int) -> int | None:
        """The ladder size a batch of ``n`` rows is padded to; None when it is above the ladder."""
        i = bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def uniform_shape(self, num_reqs: int, max_query_len: int, k: int) -> tuple[int, int] | None:
        """(rows per request, padded batch size) of a verification-layout forward: 1 row for plain decodes,
        k + 1 when some query carries drafts; None when a query is longer (a prompt chunk) or the batch is
        above the ladder."""
        width = 1 if max_query_len == 1 else k + 1
        size = self.padded_batch_size(num_reqs)
        return (width, size) if max_query_len <= width and size is not None else None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Step, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)``, replayed from the graph of ``key``; inputs must have that graph's shapes."""
        if not self.capture:
            return fn(*inputs)
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn, inputs)
        graph, static_inputs, static_outputs = self._graphs[key]
        for static, x in zip(static_inputs, inputs, strict=True):
            assert static.shape == x.shape, f"graph {key}: input of shape {tuple(x.shape)}, captured {tuple(static.shape)}"
            static.copy_(x, non_blocking=True)
        graph.replay()
        return static_outputs

    def _capture(self, fn: Step, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, tuple, tuple]:
        static_inputs = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(*static_inputs)  # warm-up; writes the same cache entries the replay will
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_outputs = fn(*static_inputs)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, static_inputs, tuple(static_outputs)


def engine_graphs(config: Any, backend: Any) -> StepGraphs | None:
    """The graphs of an engine component: on CUDA unless ``enforce_eager``, and only with a backend that builds
    metadata from a uniform layout on the device (``build_uniform_metadata``); None = eager."""
    if config.device.type != "cuda" or config.enforce_eager or not hasattr(backend, "build_uniform_metadata"):
        return None
    return StepGraphs(config.device, config.scheduler.max_num_seqs, capture=True)
