"""A model's sampling defaults: what a request that names no sampling field gets."""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.model.resolve import DEFAULT_MODEL

# The built-in model's sampling defaults: its model card recommends temperature 0.2 and top_p 0.9; the
# mild repetition penalty is measured (benchmarks/first_impressions.py: 8 of 16 answers loop without it, 0 with).
BUILT_IN_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model: str | os.PathLike | None, path: Path) -> dict:
    """What a request that names no sampling field gets: the sampling fields of the folder's
    ``generation_config.json`` (as vLLM reads them), over the built-in model's card values."""
    config = path / "generation_config.json"
    found = json.loads(config.read_text()) if config.is_file() else {}
    found = {k: v for k, v in found.items() if k in SAMPLING_FIELDS and v is not None}
    return {**BUILT_IN_SAMPLING, **found} if model is None or model == DEFAULT_MODEL else found
