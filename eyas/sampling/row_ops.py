"""The reductions over a vocabulary row that every token goes through: greedy (``argmax``), seeded
sampling (``gumbel_argmax``), the best values that top-k and top-p sort (``top_values``), the thresholds
they set (``nucleus_thresholds``) and the softmax over the values kept (``log_normaliser``,
``log_softmax_above_``).

On a CPU, float32 rows take ``eyas/kernels/token_ops.c``; a sampling step pays these per row it samples
or verifies. For a 49k-vocabulary row PyTorch's CPU argmax reads one value at a time (about 0.15 ms),
Gumbel noise built from tensors takes a dozen passes over an int64 copy of the row (about 2 ms), topk
of 1,024 values about 0.5 ms, and masking then a log_softmax eight tensor ops (0.1-0.3 ms). The Gumbel
kernel also skips blocks of 16 masked (-inf) values, which top-k and top-p leave in nearly every row.
Elsewhere (CUDA, autograd, no C compiler) the same functions run as tensor ops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eyas.kernels.token_ops import native, token_ops
from eyas.sampling.noise import gumbel

# PyTorch's CPU exp takes a slow path where its result is below float32's normal range (and at -inf): about
# 150 ns a value, against 1 ns. At temperature 0.2 most of a row's 49k scaled logits lie that far below the
# best one, and a row's normaliser alone took a millisecond. No exponent below this is ever taken: a term
# under e^-87 cannot change a float32 sum that holds a term of 1.
EXP_FLOOR = -87.0


def argmax(x: Tensor) -> Tensor:
    """x [N, V] -> [N] int64, ``x.argmax(dim=-1)`` exactly: the first of equal values, the first NaN."""
    if not (x.dim() == 2 and native(x)):
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    token_ops().argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
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
    if not (logprobs.dim() == 2 and native(logprobs)):
        return argmax(gumbel(seeds, positions, logprobs.shape[-1], stream).add_(logprobs))
    logprobs, rows = logprobs.contiguous(), logprobs.shape[0]
    seeds, positions = seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    streams = (stream.to(torch.int64) if isinstance(stream, Tensor) else torch.tensor(stream)).expand(rows).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    token_ops().gumbel_argmax(logprobs.data_ptr(), seeds.data_ptr(), positions.data_ptr(), streams.data_ptr(),
                               out.data_ptr(), rows, logprobs.shape[1], torch.get_num_threads())
    return out


def top_values(x: Tensor, width: int) -> Tensor:
    """x [N, V] -> [N, width] its rows' largest values, descending: ``torch.topk(x, width).values``."""
    if not (x.dim() == 2 and 8 * width <= x.shape[1] and native(x)):  # a wide one sorts the row: PyTorch's
        return torch.topk(x, width, dim=-1, sorted=True).values
    x = x.contiguous()
    out = torch.empty(x.shape[0], width, dtype=torch.float32)
    if token_ops().top_values(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], width, torch.get_num_threads()):
        return torch.topk(x, width, dim=-1, sorted=True).values  # a NaN: PyTorch places it
    return out


def log_normaliser(x: Tensor, floor: Tensor | None = None) -> Tensor:
    """x [N, V] -> [N, 1] log(sum(exp(x))) per row over its values >= ``floor`` [N, 1] (None: all of them),
    as logsumexp (see EXP_FLOOR)."""
    if not (x.dim() == 2 and native(x)):
        if floor is not None:
            x = x.masked_fill(x < floor, -math.inf)
        top = x.amax(dim=-1, keepdim=True)
        return top + (x - top).clamp_(min=EXP_FLOOR).exp_().sum(dim=-1, keepdim=True).log_()
    x = x.contiguous()
    floor = None if floor is None else floor.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], 1, dtype=torch.float32)
    token_ops().log_normaliser(x.data_ptr(), None if floor is None else floor.data_ptr(), out.data_ptr(),
                                x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def log_softmax_above_(x: Tensor, floor: Tensor) -> Tensor:
    """In place on x [N, V]: values below ``floor`` [N, 1] become -inf, the others their log-probability
    among the values kept (``x - log_normaliser(x, floor)``). Returns x."""
    if not (x.dim() == 2 and x.is_contiguous() and native(x)):
        return x.masked_fill_(x < floor, -math.inf).sub_(log_normaliser(x))
    floor = floor.to(torch.float32).contiguous()
    token_ops().log_softmax_above(x.data_ptr(), floor.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return x


def nucleus_thresholds(x: Tensor, k: Tensor, top_p: Tensor, width: int) -> tuple[Tensor, Tensor] | None:
    """``eyas.sampling.sampler._thresholds`` in one call of ``token_ops.c`` per batch: (threshold [N, 1],
    settled [N]) for x [N, V] float32 scaled logits, k [N] int64, top_p [N]; None where the kernel does not
    serve (not a float32 CPU row, a width too wide for its heap, a NaN), for the caller's tensor ops. Its
    probabilities take C's expf where the tensor form takes PyTorch's exp (within an ulp)."""
    if not (x.dim() == 2 and 8 * width <= x.shape[1] and native(x)):
        return None
    x = x.contiguous()
    rows = x.shape[0]
    k, top_p = k.to(torch.int64).contiguous(), top_p.to(torch.float32).contiguous()
    threshold, settled = torch.empty(rows, 1, dtype=torch.float32), torch.empty(rows, dtype=torch.bool)
    scratch = torch.empty(rows, width, dtype=torch.float32)
    if token_ops().nucleus(x.data_ptr(), k.data_ptr(), top_p.data_ptr(), threshold.data_ptr(), settled.data_ptr(),
                            scratch.data_ptr(), rows, x.shape[1], width, torch.get_num_threads()):
        return None
    return threshold, settled
