"""What a CPU target forward of n rows costs, in one-row forwards (``RowCost``, the curve adaptive drafting prices
drafts with): measured on this machine, once per CPU, kernel build (``eyas.kernels.builds_key``), weight
format, matmul precision, thread count and model shape, and kept in the cache folder (like
``eyas.kernels.bf16_mac_ratio``), so every process on the machine makes the same drafting decisions from one record.

The measurement times the target's own matrix products (every ``QuantLinear`` and ``Linear`` of the model, one
pass in order, as a forward makes them) on n rows of random activations for each n of ``ROWS``: after a warm-up
pass, ``REPEATS`` passes with the n interleaved, the fastest of each (other work on a shared machine only ever
slows a pass, and a record is kept for good). The products are what a row adds to a CPU step, with attention: the
rest of a step (norms, RoPE, Python) costs about the same at 1 and at 16 rows.

Attention grows with the keys a row reads, so it is priced per key (``RowCost.first_key``, ``per_key``): the
paged-attention kernel over every layer's own cache (cold, as a step finds them), one request of ``KEYS`` keys,
with 1 and with ``QUERIES`` query rows, the fastest of ``REPEATS`` interleaved passes. The committed row's time
over ``KEYS`` is ``first_key`` (it reads the K/V), the rows after it cost ``per_key`` each (their arithmetic).
On the default model, one Zen 4 thread: 114 ns a key for the first row, 42 ns for each further row, a layer; so a
draft row at 4,000 keys costs 5 ms of attention in 30 layers, where its products cost 0.6 ms. A model whose
attention is not the C kernel's records 0 for both. About 0.5 s for SmolLM2-135M's 121 products on 2 threads, and
0.1 s for its attention.

Example record (``<cache>/row-costs/<key>.json``): ``{"rows": [1, 2, ..., 16], "costs": [1.0, 1.08, ..., 2.9],
"first_key": 0.00075, "per_key": 0.00028, "what": "gguf @ low, 2 threads, ..."}``; a record that cannot be read is
measured again and replaced.

A hidden-state drafter's products are recorded the same way (``measured_draft_products``), in one-row passes of the
target's products: what its work grows by as it drafts for more requests (``eyas.spec_decode.adaptive.DraftCost``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from eyas.cache import cache_dir
from eyas.kernels import builds_key
from eyas.model.attention.cpu import CACHE_DTYPES
from eyas.model.attention.cpu import load_kernel as attention_kernel
from eyas.model.quantized import QuantLinear
from eyas.spec_decode.adaptive import RowCost

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
REPEATS = 5


def _products(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantLinear, nn.Linear))]


def _shapes(model: nn.Module) -> list:
    return [(type(m).__name__, m.in_features, m.out_features,
             "+".join(p.fmt.name for p in m.parts) if isinstance(m, QuantLinear) else str(m.weight.dtype))
            for m in _products(model)]


def record_path(model: nn.Module, quantization: str | None, precision: str, threads: int,
                drafter: nn.Module | None = None, cache_dtype: torch.dtype = torch.float32) -> Path:
    """The record's file: named by a hash of the CPU and the kernel builds it runs, the weights' formats and shapes
    (the drafter's too, for a drafter's record), the products' settings and the KV cache's dtype."""
    what = json.dumps([builds_key(), quantization, precision, threads, _shapes(model), str(cache_dtype)]
                      + ([] if drafter is None else ["drafter", _shapes(drafter)]))
    return cache_dir() / "row-costs" / f"{hashlib.sha256(what.encode()).hexdigest()[:16]}.json"


def _fastest(jobs: list[tuple[list[nn.Module], int]], threads: int, repeats: int) -> list[float]:
    """Seconds of each job (the products, one pass in order, on n rows of random activations): after a warm-up pass,
    ``repeats`` passes with the jobs interleaved, the fastest of each."""
    generator = torch.Generator().manual_seed(0)
    inputs = {}  # (rows, in_features) -> [rows, in_features]
    for products, n in jobs:
        for m in products:
            if (n, m.in_features) not in inputs:
                inputs[n, m.in_features] = torch.randn(n, m.in_features, generator=generator)
    times: list[list[float]] = [[] for _ in jobs]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first pass warms caches and is dropped
                for (products, n), spent in zip(jobs, times):
                    start = time.perf_counter()
                    for m in products:
                        x = inputs[n, m.in_features]
                        m(x.to(m.weight.dtype) if isinstance(m, nn.Linear) else x)
                    spent.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return [min(spent[1:]) for spent in times]


def _rising(times: list[float], unit: float) -> tuple[float, ...]:
    """``times`` over ``unit``, never below the fewer rows' figure: a row is not cheaper than none (timing noise)."""
    costs: list[float] = []
    for t in times:
        costs.append(max(costs[-1] if costs else 0.0, round(t / unit, 4)))
    return tuple(costs)


KEYS, QUERIES, BLOCK = 1024, 9, 16  # the attention's timed request: its keys, its most rows, the cache's block


def _attention_seconds(model: nn.Module, cache_dtype: torch.dtype, threads: int, repeats: int) -> tuple[float, float]:
    """Seconds of the paged-attention kernel over every layer of ``model`` (each its own cache) for one request of
    KEYS keys with 1 and with QUERIES rows (after a warm-up pass, the fastest of ``repeats`` interleaved passes);
    (0, 0) where the model's layers or the kernel are not there."""
    kernel = attention_kernel()
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    if kernel is None or not layers or cache_dtype not in CACHE_DTYPES:
        return 0.0, 0.0
    heads, kv_heads, d = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, KEYS, kv_heads, d, generator=generator).to(cache_dtype) for _ in layers]
    table = torch.arange(KEYS // BLOCK, dtype=torch.int64)[None]  # [1, blocks] the request's blocks in order

    def job(rows: int):
        q = torch.randn(rows, heads, d, generator=generator)
        kv = torch.randn(2, rows, kv_heads, d, generator=generator).to(cache_dtype)
        slots = torch.arange(KEYS - rows, KEYS)  # the rows' own K/V are written where a step writes them
        requests = torch.tensor([[0], [rows], [KEYS], [0]], dtype=torch.int64)
        out = torch.empty(rows, heads, d)
        return q, kv, slots, requests, out

    jobs = [job(1), job(QUERIES)]
    times: list[list[float]] = [[], []]
    for _ in range(repeats + 1):  # the first pass warms caches and is dropped
        for (q, kv, slots, requests, out), spent in zip(jobs, times):
            start = time.perf_counter()
            for cache in caches:
                kernel(q.data_ptr(), heads * d, kv[0].data_ptr(), kv_heads * d, kv[1].data_ptr(), kv_heads * d,
                       cache.data_ptr(), KEYS, CACHE_DTYPES[cache_dtype], out.data_ptr(), heads, kv_heads, d,
                       d ** -0.5, slots.data_ptr(), len(slots), table.data_ptr(), table.shape[1], BLOCK,
                       requests.data_ptr(), 1, 0, threads)
            spent.append(time.perf_counter() - start)
    one, more = (min(spent[1:]) for spent in times)
    return one, max(0.0, more - one)


def measure(model: nn.Module, threads: int, cache_dtype: torch.dtype = torch.float32,
            repeats: int = REPEATS) -> RowCost:
    """The products' time at each n of ROWS over their time at one row (best of ``repeats`` interleaved passes), and
    attention's per key of a request's context in the same unit (``RowCost.first_key``, ``per_key``)."""
    times = _fastest([(_products(model), n) for n in ROWS], threads, repeats)
    one, more = _attention_seconds(model, cache_dtype, threads, repeats)  # the kernel is given its threads
    unit = times[0] * KEYS
    return RowCost(tuple(zip(ROWS, _rising(times, times[0]))), round(one / unit, 8),
                   round(more / (QUERIES - 1) / unit, 8))


def measured_row_cost(model: nn.Module, quantization: str | None, precision: str, threads: int,
                      cache_dtype: torch.dtype = torch.float32) -> RowCost:
    """This machine's curve for the model's products and attention: read from its record, or measured now and
    recorded."""
    return _recorded(record_path(model, quantization, precision, threads, cache_dtype=cache_dtype),
                     lambda: measure(model, threads, cache_dtype),
                     f"{quantization} @ {precision}, {threads} threads, {len(_products(model))} products, "
                     f"{cache_dtype} KV cache")


DRAFT_ROWS = (1, 2, 4, 8, 16, 32, 64)


def measured_draft_products(drafter: nn.Module, target: nn.Module, quantization: str | None, precision: str,
                            threads: int) -> RowCost:
    """A drafter's products by rows (``DRAFT_ROWS``), in one-row passes of the target's products, the two timed
    interleaved (``eyas.spec_decode.adaptive.DraftCost`` reads it): from its record, or measured now and recorded.
    About 0.3 s for the shipped EAGLE-3 drafter on one thread."""
    def measure_both() -> RowCost:
        times = _fastest([(_products(target), 1)] + [(_products(drafter), n) for n in DRAFT_ROWS], threads, REPEATS)
        return RowCost(tuple(zip(DRAFT_ROWS, _rising(times[1:], times[0]))))

    return _recorded(record_path(target, quantization, precision, threads, drafter), measure_both,
                     f"drafter products over the target's at one row, {quantization} @ {precision}, {threads} threads")


def _recorded(path: Path, measure_now: Callable[[], RowCost], what: str) -> RowCost:
    """The curve in the record at ``path``; a record that is missing or cannot be read is measured and written."""
    try:
        record = json.loads(path.read_text())
        return RowCost(tuple(zip(record["rows"], record["costs"])), record["first_key"], record["per_key"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cost = measure_now()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"rows": [n for n, _ in cost.points], "costs": [c for _, c in cost.points],
                   "first_key": cost.first_key, "per_key": cost.per_key, "what": what}, f)
    os.replace(tmp, path)
    return cost
