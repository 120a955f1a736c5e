"""What a CPU target forward of n rows costs, in one-row forwards (``RowCost``, the curve adaptive drafting prices
drafts with): measured on this machine, once per CPU, kernel build (``eyas.kernels.builds_key``), weight
format, matmul precision, thread count and model shape, and kept in the cache folder (like
``eyas.kernels.bf16_mac_ratio``), so every process on the machine makes the same drafting decisions from one record.

The measurement times the target's own matrix products (every ``QuantLinear`` and ``Linear`` of the model, one
pass in order, as a forward makes them) on n rows of random activations for each n of ``ROWS``: after a warm-up
pass, ``REPEATS`` passes with the n interleaved, the fastest of each (other work on a shared machine only ever
slows a pass, and a record is kept for good). The products are what a row adds to a CPU step; the rest of a step (norms,
RoPE, the attention call, Python) costs about the same at 1 and at 16 rows, so a whole step's curve is flatter and
this one errs on the side of verifying fewer drafts. About 0.5 s for SmolLM2-135M's 121 products on 2 threads.

Example record (``<cache>/row-costs/<key>.json``): ``{"rows": [1, 2, ..., 16], "costs": [1.0, 1.08, ..., 2.9],
"what": "gguf @ low, 2 threads, ..."}``; a record that cannot be read is measured again and replaced.

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
                drafter: nn.Module | None = None) -> Path:
    """The record's file: named by a hash of the CPU and the kernel builds it runs, the weights' formats and shapes
    (the drafter's too, for a drafter's record) and the products' settings."""
    what = json.dumps([builds_key(), quantization, precision, threads, _shapes(model)]
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


def measure(model: nn.Module, threads: int, repeats: int = REPEATS) -> tuple[float, ...]:
    """The products' time at each n of ROWS over their time at one row (best of ``repeats`` interleaved passes)."""
    times = _fastest([(_products(model), n) for n in ROWS], threads, repeats)
    return _rising(times, times[0])


def measured_row_cost(model: nn.Module, quantization: str | None, precision: str, threads: int) -> RowCost:
    """This machine's curve for the model's products: read from its record, or measured now and recorded."""
    return _recorded(record_path(model, quantization, precision, threads), ROWS, lambda: measure(model, threads),
                     f"{quantization} @ {precision}, {threads} threads, {len(_products(model))} products")


DRAFT_ROWS = (1, 2, 4, 8, 16, 32, 64)


def measured_draft_products(drafter: nn.Module, target: nn.Module, quantization: str | None, precision: str,
                            threads: int) -> RowCost:
    """A drafter's products by rows (``DRAFT_ROWS``), in one-row passes of the target's products, the two timed
    interleaved (``eyas.spec_decode.adaptive.DraftCost`` reads it): from its record, or measured now and recorded.
    About 0.3 s for the shipped EAGLE-3 drafter on one thread."""
    def measure_both() -> tuple[float, ...]:
        times = _fastest([(_products(target), 1)] + [(_products(drafter), n) for n in DRAFT_ROWS], threads, REPEATS)
        return _rising(times[1:], times[0])

    return _recorded(record_path(target, quantization, precision, threads, drafter), DRAFT_ROWS, measure_both,
                     f"drafter products over the target's at one row, {quantization} @ {precision}, {threads} threads")


def _recorded(path: Path, rows: tuple[int, ...], measure_now: Callable[[], tuple[float, ...]], what: str) -> RowCost:
    """The curve in the record at ``path``; a record that is missing or cannot be read is measured and written."""
    try:
        record = json.loads(path.read_text())
        return RowCost(tuple(zip(record["rows"], record["costs"])))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure_now()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"rows": list(rows), "costs": list(costs), "what": what}, f)
    os.replace(tmp, path)
    return RowCost(tuple(zip(rows, costs)))
