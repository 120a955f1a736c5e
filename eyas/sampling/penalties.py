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
    penalties pass through, and a batch without any costs nothing.

    Only the tokens a row has seen change (a token never seen is neither scaled nor lowered), so the batch is
    penalized at once over its (row, seen token) pairs, in a dozen tensor operations whatever the batch. Per
    request and over the whole vocabulary it took 5.3 ms of a 42 ms batch-16 step at the default model's
    sampling settings (repetition penalty 1.1, 2 threads, profiled); over pairs keyed and counted in Python
    (dict, Counter) 2.1 ms for 16 rows of 264 tokens; as one tensor of keys counted by torch.unique, 1.15 ms.
    """
    if not any(p.has_penalties for p, *_ in rows):
        return logits
    out = logits.to(torch.float32, copy=True)
    vocab, device = out.shape[-1], out.device
    seen_ids, prompt_ids = [], []  # the tokens each row saw in its output and drafts, and in its prompt
    seen_len, prompt_len, factors = [], [], []  # per row: how many of each; (repetition, frequency, presence)
    start = 0
    for params, token_ids, num_prompt, drafts in rows:
        n = len(drafts) + 1
        if params.has_penalties:
            if params.logit_bias:
                bias = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
                out[start:start + n, bias] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32,
                                                           device=device)
            output = token_ids[num_prompt:]
            for j in range(n):  # row j also counts drafts 0..j-1
                seen_ids += output
                seen_ids += drafts[:j]
                seen_len.append(len(output) + j)
            if params.repetition_penalty != 1.0:
                prompt_ids += token_ids[:num_prompt] * n
                prompt_len += [num_prompt] * n
            else:
                prompt_len += [0] * n
        else:
            seen_len += [0] * n
            prompt_len += [0] * n
        factors += [(params.repetition_penalty, params.frequency_penalty, params.presence_penalty)] * n
        start += n
    if not seen_ids and not prompt_ids:
        return out
    row_ids = torch.arange(start, dtype=torch.int64, device=device)
    keys = torch.tensor(seen_ids + prompt_ids, dtype=torch.int64, device=device) + vocab * torch.cat(
        [row_ids.repeat_interleave(torch.tensor(seen_len, device=device)),
         row_ids.repeat_interleave(torch.tensor(prompt_len, device=device))])  # row * V + token, each occurrence
    keys, occurrence = torch.unique(keys, return_inverse=True)  # [S] the (row, token) pairs, sorted
    counts = torch.bincount(occurrence[:len(seen_ids)], minlength=len(keys))  # [S] in the output and drafts
    row, token = keys // vocab, keys % vocab
    repetition, frequency, presence = torch.tensor(factors, dtype=torch.float32, device=device)[row].unbind(1)
    seen = counts > 0
    x = out[row, token]  # [S]
    scaled = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(repetition != 1.0, scaled, x)  # every pair of such a row was seen or is in its prompt
    x = x - frequency * counts
    x = x - presence * seen
    out[row, token] = x
    return out
