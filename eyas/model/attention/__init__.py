"""Attention backends over the paged KV cache, behind one interface (``base.py``) and picked by name."""

from __future__ import annotations

import importlib

import torch

from eyas.model.attention.base import (
    AttentionBackend,
    AttentionBatch,
    UniformBatch,
    block_table_tensor,
    layout_slots,
    request_slots,
    uniform_slots,
)

__all__ = ["AttentionBackend", "AttentionBatch", "UniformBatch", "block_table_tensor", "layout_slots", "request_slots",
           "uniform_slots", "default_backend", "get_backend"]

_BACKENDS = {"sdpa": ("eyas.model.attention.sdpa", "SdpaBackend"),
             "cpu": ("eyas.model.attention.cpu", "CpuBackend"),
             "flex": ("eyas.model.attention.flex", "FlexBackend")}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: '{name}' is not one of {', '.join(sorted(_BACKENDS))}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def default_backend(device: torch.device) -> str:
    """cpu on a CPU where its C kernel builds (else sdpa); sdpa on CUDA: flex's flat varlen layout is
    correct on CUDA but ~28x slower per layer than sdpa at decode batch 32 (one query tile walks
    every request's keys)."""
    if device.type == "cpu":
        from eyas.model.attention.cpu import load_kernel

        return "cpu" if load_kernel() is not None else "sdpa"
    return "sdpa"
