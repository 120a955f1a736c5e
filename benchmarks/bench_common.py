"""Argument types shared by the benchmark scripts (imported as a sibling module)."""

from __future__ import annotations

import argparse


def batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; every size >= 1, at least one."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least one size, all >= 1")
    return sizes
