"""Counter-based randomness keyed by (seed, position, stream): no generator state anywhere.

A request's random numbers for the token at sequence index ``position`` are a pure function of
``(seed, position, stream, vocab index)``. So a seeded request samples the same tokens alone or in
any batch, in any row order, on CPU or CUDA, with or without speculation.

The hash (all arithmetic in int64 tensors, every value kept in [0, 2^32); an int64 multiply wraps
mod 2^64, which keeps the low 32 bits exact, and ``& 0xFFFFFFFF`` drops the rest)::

    fmix32(h):  h ^= h >> 16; h = h * 0x85EBCA6B; h ^= h >> 13; h = h * 0xC2B2AE35; h ^= h >> 16
                (the murmur3 finaliser: a bijection on 32-bit words with full avalanche)

    row key     k = fmix32(lo32(seed) ^ 0x9E3779B9)
                k = fmix32(k ^ hi32(seed))
                k = fmix32(k ^ lo32(position))
                k = fmix32(k ^ lo32(stream * 0x632BE5AB))
    column salt c[v] = fmix32(lo32(v * 0x9E3779B1 + 0x7F4A7C15))          (cached per size/device)
    bits        x[n, v] = fmix32(k[n] ^ c[v])
    uniform     u = ((x >> 9) + 0.5) / 2^23          in [2^-24, 1 - 2^-24], exact in float32

Example: ``uniform(torch.tensor([7]), torch.tensor([3]), stream=1, size=4)`` returns the same four
numbers on every call, device and batch; row ``i`` of any batched call depends only on
``(seeds[i], positions[i])``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF


def _fmix32_(h: Tensor, tmp: Tensor) -> Tensor:
    """murmur3 fmix32 in place on an int64 tensor of values in [0, 2^32); `tmp` is scratch."""
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=tmp))
    h.mul_(0x85EBCA6B).bitwise_and_(_MASK)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 13, out=tmp))
    h.mul_(0xC2B2AE35).bitwise_and_(_MASK)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=tmp))
    return h


def _fmix32(h: Tensor) -> Tensor:
    return _fmix32_(h.clone(), torch.empty_like(h))


@functools.lru_cache(maxsize=16)
def _column_salt(size: int, device: torch.device) -> Tensor:
    v = torch.arange(size, dtype=torch.int64, device=device)  # [size]
    return _fmix32((v * 0x9E3779B1 + 0x7F4A7C15) & _MASK)


def _row_key(seeds: Tensor, positions: Tensor, stream: int | Tensor) -> Tensor:
    """[N] int64 in [0, 2^32): a hash of (seed, position, stream) for each row."""
    seeds = seeds.to(torch.int64)
    k = _fmix32((seeds & _MASK) ^ 0x9E3779B9)
    k = _fmix32(k ^ ((seeds >> 32) & _MASK))
    k = _fmix32(k ^ (positions.to(torch.int64) & _MASK))
    if isinstance(stream, Tensor):
        stream = stream.to(device=k.device, dtype=torch.int64)
    return _fmix32(k ^ ((stream * 0x632BE5AB) & _MASK))


def uniform(seeds: Tensor, positions: Tensor, stream: int | Tensor, size: int) -> Tensor:
    """[N, size] float32 uniforms in (0, 1), never exactly 0 or 1.

    seeds [N] int64 (any 64-bit value), positions [N] int64, stream: an int, or an [N] tensor to
    pick a stream per row. Row n is a pure function of (seeds[n], positions[n], stream[n]).
    """
    key = _row_key(seeds, positions, stream)  # [N]
    x = key[:, None] ^ _column_salt(size, key.device)  # [N, size]
    tmp = torch.empty_like(x)
    _fmix32_(x, tmp)
    u = x.bitwise_right_shift_(9).to(torch.float32)  # 23 random bits, exact in float32
    return u.add_(0.5).mul_(2.0**-23)


def gumbel(seeds: Tensor, positions: Tensor, size: int, stream: int | Tensor = 0) -> Tensor:
    """[N, size] float32 standard Gumbel noise -log(-log(u)); stream 0 is the sampler's own.

    ``argmax(logprobs + gumbel(...))`` is an exact sample from softmax(logprobs) (Gumbel-max).
    """
    return uniform(seeds, positions, stream, size).log_().neg_().log_().neg_()
