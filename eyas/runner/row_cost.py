"""What a CPU target forward of n rows costs, in one-row forwards (``RowCost``, the curve adaptive drafting prices
drafts with): measured on this machine, once per CPU, weight format, matmul precision, thread count and model
shape, and kept in the cache folder (like ``eyas.kernels.bf16_mac_ratio``), so every process on the machine makes
the same drafting decisions from one record.

The measurement times the target's own matrix products (every ``QuantLinear`` and ``Linear`` of the model, one
pass in order, as a forward makes them) on n rows of random activations for each n of ``ROWS``: after a warm-up
pass, ``REPEATS`` passes with the n interleaved, the fastest of each (other work on a shared machine only ever
slows a pass, and a record is kept for good). The products are what a row adds to a CPU step; the rest of a step (norms,
RoPE, the attention call, Python) costs about the same at 1 and at 16 rows, so a whole step's curve is flatter and
this one errs on the side of verifying fewer drafts. About 0.5 s for SmolLM2-135M's 121 products on 2 threads.

Example record (``<cache>/row-costs/<key>.json``): ``{"rows": [1, 2, ..., 16], "costs": [1.0, 1.08, ..., 2.9],
"what": "gguf @ low, 2 threads, ..."}``; a record that cannot be read is measured again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from eyas.cache import cache_dir
from eyas.kernels import cpu_key
from eyas.model.quantized import QuantLinear
from eyas.spec_decode.adaptive import RowCost

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
REPEATS = 5


def _products(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantLinear, nn.Linear))]


def record_path(model: nn.Module, quantization: str | None, precision: str, threads: int) -> Path:
    """The record's file: named by a hash of the CPU, the weights' formats and shapes and the products' settings."""
    shapes = [(type(m).__name__, m.in_features, m.out_features,
               "+".join(p.fmt.name for p in m.parts) if isinstance(m, QuantLinear) else str(m.weight.dtype))
              for m in _products(model)]
    what = json.dumps([cpu_key(), quantization, precision, threads, shapes])
    return cache_dir() / "row-costs" / f"{hashlib.sha256(what.encode()).hexdigest()[:16]}.json"


def measure(model: nn.Module, threads: int, repeats: int = REPEATS) -> tuple[float, ...]:
    """The products' time at each n of ROWS over their time at one row (best of ``repeats`` interleaved passes)."""
    products = _products(model)
    generator = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            inputs = {n: {k: torch.randn(n, k, generator=generator) for k in {m.in_features for m in products}}
                      for n in ROWS}
            for _ in range(repeats + 1):  # the first pass warms caches and is dropped
                for n in ROWS:
                    start = time.perf_counter()
                    for m in products:
                        m(inputs[n][m.in_features].to(m.weight.dtype) if isinstance(m, nn.Linear)
                          else inputs[n][m.in_features])
                    times[n].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    best = {n: min(t[1:]) for n, t in times.items()}
    costs = [1.0]
    for n in ROWS[1:]:  # never below the fewer rows' cost: a row is not cheaper than none (timing noise)
        costs.append(max(costs[-1], round(best[n] / best[1], 3)))
    return tuple(costs)


def measured_row_cost(model: nn.Module, quantization: str | None, precision: str, threads: int) -> RowCost:
    """This machine's curve for the model's products: read from its record, or measured now and recorded."""
    path = record_path(model, quantization, precision, threads)
    try:
        record = json.loads(path.read_text())
        return RowCost(tuple(zip(record["rows"], record["costs"])))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure(model, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"rows": list(ROWS), "costs": list(costs),
                   "what": f"{quantization} @ {precision}, {threads} threads, {len(_products(model))} products"}, f)
    os.replace(tmp, path)
    return RowCost(tuple(zip(ROWS, costs)))
