"""The draft vocabulary of an EAGLE-3 drafter: the most frequent target ids among the tokens it is trained
to predict (loss-masked tokens), sorted ascending.

Example: frequencies {7: 5, 3: 9, 12: 1}, size 2 -> ids [3, 7]; size 4 -> [3, 7, 12] plus the lowest
unused id, 0 -> [0, 3, 7, 12]. The engine maps draft id i to target id ``i + d2t[i]``.
"""

from __future__ import annotations

from collections import Counter

import torch


def select_draft_vocabulary(frequencies: Counter[int], size: int, vocab_size: int) -> torch.Tensor:
    """[min(size, vocab_size)] int64 ascending target ids: the most frequent first (ties: lower id), then
    the lowest ids never seen, so the vocabulary always has exactly that many entries."""
    size = min(size, vocab_size)
    ranked = sorted((t for t in frequencies if 0 <= t < vocab_size and frequencies[t] > 0),
                    key=lambda t: (-frequencies[t], t))[:size]
    chosen = set(ranked)
    fill = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(fill))
    return torch.tensor(sorted(chosen), dtype=torch.int64)
