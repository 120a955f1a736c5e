"""The reductions over a vocabulary row that every token goes through: greedy (``argmax``), seeded
sampling (``gumbel_argmax``) and the best values that top-k and top-p sort (``top_values``).

On a CPU, float32 rows take ``eyas/kernels/token_ops.c``; a sampling step pays these per row it samples
or verifies. For a 49k-vocabulary row PyTorch's CPU argmax reads one value at a time (about 0.15 ms),
Gumbel noise built from tensors takes a dozen passes over an int64 copy of the row (about 2 ms), and
topk of 1,024 values about 0.5 ms. The Gumbel kernel also skips blocks of 16 masked (-inf) values,
which top-k and top-p leave in nearly every row. Elsewhere (CUDA, autograd, no C compiler) the same
functions run as tensor ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.model.layers import _native, _token_ops
from eyas.sampling.noise import gumbel


def argmax(x: Tensor) -> Tensor:
    """x [N, V] -> [N] int64, ``x.argmax(dim=-1)`` exactly: the first of equal values, the first NaN."""
    if not (x.dim() == 2 and _native(x)):
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _token_ops().argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def gumbel_argmax(logprobs: Tensor, seeds: Tensor, positions: Tensor, stream: int | Tensor = 0) -> Tensor:
    """[N] int64 = argmax(logprobs + gumbel(seed, position, stream)): an exact sample per row.

    The one function through which every random token is drawn (plain sampling on stream 0,
    the bonus token, shared-noise verification, the recovered token on stream 2), so plain
    and speculative decoding agree token for token. logprobs [N, V] may be unnormalised.

    The kernel hashes the same uniforms as ``eyas.sampling.noise`` bit for bit; its log is its own
    (within 1 ulp of the true value, as PyTorch's), so a CPU and a CUDA run may part where two
    scores are within an ulp.
    """
    if not (logprobs.dim() == 2 and _native(logprobs)):
        return argmax(gumbel(seeds, positions, logprobs.shape[-1], stream).add_(logprobs))
    logprobs, rows = logprobs.contiguous(), logprobs.shape[0]
    seeds, positions = seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    streams = (stream.to(torch.int64) if isinstance(stream, Tensor) else torch.tensor(stream)).expand(rows).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    _token_ops().gumbel_argmax(logprobs.data_ptr(), seeds.data_ptr(), positions.data_ptr(), streams.data_ptr(),
                               out.data_ptr(), rows, logprobs.shape[1], torch.get_num_threads())
    return out


def top_values(x: Tensor, width: int) -> Tensor:
    """x [N, V] -> [N, width] its rows' largest values, descending: ``torch.topk(x, width).values``."""
    if not (x.dim() == 2 and 8 * width <= x.shape[1] and _native(x)):  # a wide one sorts the row: PyTorch's
        return torch.topk(x, width, dim=-1, sorted=True).values
    x = x.contiguous()
    out = torch.empty(x.shape[0], width, dtype=torch.float32)
    if _token_ops().top_values(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], width, torch.get_num_threads()):
        return torch.topk(x, width, dim=-1, sorted=True).values  # a NaN: PyTorch places it
    return out
