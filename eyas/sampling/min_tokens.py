"""``min_tokens``: no output ends before it, its stop tokens held back (vLLM's and HF's meaning).

A verify row whose token would be output number i (0-based) with i < min_tokens gets -inf for the request's stop
tokens: its end-of-sequence ids (unless ``ignore_eos``) and its ``stop_token_ids``. So they are never sampled there,
and the output does not hold an end-of-sequence token it then runs past. Under speculation row j of a request that
has made m outputs would emit output m + j, so the rows of drafts are held exactly as decoding a token a step would
hold them. A request with a grammar is left alone: its grammar says when the output may end (an end-of-sequence
token is the only one it admits once it is complete).

Example: min_tokens 3, eos {2}, stop_token_ids [9], 1 output made, 3 drafts: rows 0 and 1 (outputs 1 and 2) get
-inf at tokens 2 and 9; rows 2 and 3 (outputs 3 and 4) are untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.sampling.params import SamplingParams


def hold_stops(logits: Tensor, rows: list[tuple[SamplingParams, frozenset[int], int, int, bool]]) -> Tensor:
    """logits [N, V] of consecutive verify rows; ``rows``: per request, in row order, (params, its end-of-sequence
    ids, outputs it has made, drafts it verifies, whether it has a grammar); request r owns drafts + 1 rows.
    Returns new logits with the held stop tokens at -inf, or ``logits`` itself when no row is held."""
    held_rows, held_tokens = [], []  # the (row, token) cells set to -inf
    start = 0
    for params, eos, made, drafts, grammar in rows:
        held = min(drafts + 1, params.min_tokens - made) if not grammar else 0  # rows 0 .. held - 1
        if held > 0:
            stops = sorted((set() if params.ignore_eos else set(eos)) | set(params.stop_token_ids or ()))
            stops = [t for t in stops if t < logits.shape[-1]]  # a tokenizer's EOS past the model's vocabulary
            held_rows += [start + j for j in range(held) for _ in stops]
            held_tokens += stops * held
        start += drafts + 1
    if not held_rows:
        return logits
    out = logits.clone()
    out[torch.tensor(held_rows, device=out.device), torch.tensor(held_tokens, device=out.device)] = float("-inf")
    return out
