"""Which tokens a verify row may sample, beside its grammar: ``allowed_token_ids`` and ``min_tokens``.

* ``allowed_token_ids`` (vLLM's): every other token gets -inf in each of the request's rows.
* ``min_tokens`` (vLLM's and HF's meaning): no output ends before it. A row whose token would be output number i
  (0-based) with i < min_tokens gets -inf for the request's stop tokens: its end-of-sequence ids (unless
  ``ignore_eos``) and its ``stop_token_ids``. So they are never sampled there, and the output does not hold an
  end-of-sequence token it then runs past. Under speculation row j of a request that has made m outputs would emit
  output m + j, so the rows of drafts are held exactly as decoding a token a step holds them. A request with a
  grammar is left to it (its grammar says when the output may end: an end-of-sequence token is the only one it
  admits once it is complete), and so is one whose allowed tokens are all stop tokens: a row is never emptied.

Example: min_tokens 3, eos {2}, stop_token_ids [9], 1 output made, 3 drafts: rows 0 and 1 (outputs 1 and 2) get
-inf at tokens 2 and 9; rows 2 and 3 (outputs 3 and 4) are untouched. With allowed_token_ids [2, 5, 9] as well,
every row has -inf everywhere but 2, 5 and 9, and rows 0 and 1 at 2 and 9 too: they sample 5.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.sampling.params import SamplingParams


def restrict(logits: Tensor, rows: list[tuple[SamplingParams, frozenset[int], int, int, bool]]) -> Tensor:
    """logits [N, V] of consecutive verify rows; ``rows``: per request, in row order, (params, its end-of-sequence
    ids, outputs it has made, drafts it verifies, whether it has a grammar); request r owns drafts + 1 rows.
    Returns new logits with the tokens a row may not sample at -inf, or ``logits`` itself when none is."""
    vocab, out = logits.shape[-1], None
    held_rows, held_tokens = [], []  # min_tokens: the (row, stop token) cells set to -inf
    start = 0
    for params, eos, made, drafts, grammar in rows:
        n, allowed = drafts + 1, params.allowed_token_ids
        if allowed is not None:
            out = logits.clone() if out is None else out
            keep = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            keep[torch.tensor(allowed, device=out.device)] = True
            out[start:start + n].masked_fill_(~keep, float("-inf"))
        held = min(n, params.min_tokens - made) if not grammar else 0  # rows 0 .. held - 1
        if held > 0:
            stops = (set() if params.ignore_eos else set(eos)) | set(params.stop_token_ids or ())
            stops = {t for t in stops if t < vocab}  # a tokenizer's EOS past the model's vocabulary
            if allowed is None or not set(allowed) <= stops:
                held_rows += [start + j for j in range(held) for _ in stops]
                held_tokens += sorted(stops) * held
        start += n
    if held_rows:
        out = logits.clone() if out is None else out
        out[torch.tensor(held_rows, device=out.device), torch.tensor(held_tokens, device=out.device)] = float("-inf")
    return logits if out is None else out
