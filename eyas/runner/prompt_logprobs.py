"""Prompt logprobs: the logprob of every prompt token given the tokens before it (vLLM's ``prompt_logprobs``).

A request that asks for them (``SamplingParams.prompt_logprobs``) skips the prefix cache, so every prompt
position runs through the target. In each step that runs a chunk of its prompt, the hidden state at
chunk position ``p`` gives the distribution of token ``p + 1``; the positions whose next token is still
a prompt token are read.

Example: a 5-token prompt ``[a, b, c, d, e]`` in chunks of 3 and 2. Step 1 runs positions 0..2 and
reads the logprobs of ``b, c, d`` (first token index 1); step 2 runs 3..4 and reads ``e`` only (position
4 predicts the first output token, which is the sampler's). Token 0 has none (``None`` in the output).
"""

from __future__ import annotations

import torch

from eyas.sampling.sampler import raw_logprobs

PromptLogprobs = dict[str, tuple[int, list[dict[int, float]]]]  # RunnerOutput.prompt_logprobs


def prompt_logprobs(compute_logits, hidden: torch.Tensor, scheduled: list, query_start_loc: torch.Tensor
                    ) -> PromptLogprobs:
    """``hidden`` [num_tokens, H] of the step in the flat layout; ``scheduled``: the plan's ``ScheduledRequest``s."""
    out: PromptLogprobs = {}
    for i, entry in enumerate(scheduled):
        request, n = entry.request, entry.request.params.prompt_logprobs
        if n is None:
            continue
        count = min(entry.num_new_tokens, request.num_prompt_tokens - 1 - entry.start)  # positions with a next prompt token
        if count <= 0:
            continue
        rows = torch.arange(count) + int(query_start_loc[i])
        targets = torch.tensor(request.token_ids[entry.start + 1:entry.start + 1 + count], dtype=torch.int64,
                               device=hidden.device)  # [count]
        lp = raw_logprobs(compute_logits(hidden[rows.to(hidden.device)]), targets, max(n, 1))
        token_lp, top_ids, top_lp = lp.sampled_logprobs.tolist(), lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
        entries = []
        for j, token in enumerate(targets.tolist()):
            entry_lp = dict(zip(top_ids[j][:n], top_lp[j][:n]))
            entry_lp[token] = token_lp[j]
            entries.append(entry_lp)
        out[request.request_id] = (entry.start + 1, entries)
    return out
