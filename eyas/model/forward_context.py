"""Per-batch attention metadata, set by the runner and read by attention layers.

Model code stays a plain transformer: an attention layer asks the current context for
the metadata of its KV-cache group and for the backend that consumes it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class ForwardContext:
    backend: Any  # eyas.model.attention.AttentionBackend
    attn_metadata: dict[int, Any]  # KV-cache group id -> backend metadata


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention layers run only inside runner.forward_context(...)"
    return _current
