"""Logit bias and the presence, frequency and repetition penalties (OpenAI's and vLLM's meanings),
applied to raw logits before the sampler processes them.

For the token at sequence index ``p`` of a request, with ``counts[t]`` = how often token t occurs
in the output before ``p`` and ``prompt`` = the prompt's set of tokens:

    logits[t] += logit_bias[t]
    logits[t] /= r if logits[t] > 0 else 1/r        for t in prompt or counts[t] > 0 (r = repetition)
    logits[t] -= frequency * counts[t] + presence * (counts[t] > 0)

Under speculation the verify row of draft j counts the committed output *and* drafts 0..j-1 (the
tokens that precede it if they are accepted), so every row sees exactly the history it would have
without speculation, and greedy and shared-noise outputs stay identical.

Example: prompt [5], output so far [7, 7], drafts [9]; repetition 2, frequency 0.5, presence 1.
Row 0 (token after the second 7): logits[5] halves (or doubles if negative), logits[7] halves then
loses 0.5 * 2 + 1 = 2; logits[9] is untouched. Row 1 (after draft 9): the same, and logits[9]
halves then loses 0.5 + 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.sampling.params import SamplingParams


def penalize(logits: Tensor, rows: list[tuple[SamplingParams, list[int], int, list[int]]]) -> Tensor:
    """logits [N, V] of consecutive verify rows; ``rows``: per request, in row order, (params, token ids
    (prompt then output), number of prompt tokens, drafts). Request r owns ``len(drafts) + 1`` rows.
    Returns new logits (the input is kept: logprobs report the raw distribution); requests without
    penalties pass through, and a batch without any costs nothing."""
    if not any(p.has_penalties for p, *_ in rows):
        return logits
    out = logits.to(torch.float32, copy=True)
    vocab, device = out.shape[-1], out.device
    start = 0
    for params, token_ids, num_prompt, drafts in rows:
        n = len(drafts) + 1
        if params.has_penalties:
            out[start:start + n] = _penalize_request(out[start:start + n], params, token_ids[:num_prompt],
                                                     token_ids[num_prompt:], drafts, vocab, device)
        start += n
    return out


def _penalize_request(x: Tensor, params: SamplingParams, prompt: list[int], output: list[int], drafts: list[int],
                      vocab: int, device: torch.device) -> Tensor:
    """x [n, V] = the rows of one request (row j follows drafts[:j])."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        x[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    committed = torch.bincount(torch.tensor(output, dtype=torch.int64, device=device), minlength=vocab)  # [V]
    counts = committed.expand(len(x), vocab).clone()  # [n, V]
    if drafts:  # row j also counts drafts 0..j-1
        steps = torch.zeros(len(x), vocab, dtype=counts.dtype, device=device)
        steps[torch.arange(1, len(x), device=device), torch.tensor(drafts, dtype=torch.int64, device=device)] = 1
        counts += steps.cumsum(dim=0)
    seen = counts > 0  # [n, V]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_prompt[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        hit = seen | in_prompt
        scaled = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        x = torch.where(hit, scaled, x)
    if params.frequency_penalty:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty:
        x = x - params.presence_penalty * seen
    return x
