"""``--online``: training data without dumps. Conversations are rendered with the chat template and
assistant-only loss masks (as ``eyas extract`` does), and each batch's target states are computed by
the frozen target inside the training loop, with plain causal attention over the padded batch."""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from torch import nn

from eyas.data.chat import build_loss_mask
from eyas.data.sharegpt import conversations, without_leading_replies
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.model.tokenizer import Tokenizer
from eyas.train.attention import LayerKeys, TrainingAttention
from eyas.train.data import Batch


class OnlineData:
    """The usable conversations among the first ``max_samples`` of each of ``sources`` ('sharegpt', ShareGPT
    .json or .jsonl files, in order), as one dataset."""

    def __init__(self, sources: tuple[str, ...], tokenizer: Tokenizer, target: nn.Module,
                 aux_layer_ids: tuple[int, ...], *, max_len: int, max_samples: int | None):
        self.target = target
        self.aux_layer_ids = tuple(sorted(aux_layer_ids))
        self.rows: list[tuple[list[int], list[int]]] = []
        self.frequencies: Counter[int] = Counter()
        render = lambda m, gen: tokenizer.apply_chat_template(m, add_generation_prompt=gen)  # noqa: E731
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        chats = itertools.chain.from_iterable(itertools.islice(conversations(s), max_samples) for s in sources)
        for conversation in chats:
            try:
                ids, mask = build_loss_mask(render, encode, without_leading_replies(conversation).messages)
            except ValueError:
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            if any(mask):
                self.rows.append((ids, mask))
                self.frequencies.update(t for t, m in zip(ids, mask) if m)
        if not self.rows:
            raise ValueError(f"data: no usable conversation in {', '.join(repr(s) for s in sources)} (an empty dataset)")

    def lengths(self, max_len: int) -> list[int]:
        return [min(len(ids), max_len) for ids, _ in self.rows]

    @torch.no_grad()
    def batch(self, indices: list[int], max_len: int, dtype: torch.dtype) -> Batch:
        rows = [self.rows[i] for i in indices]
        seq = max(min(len(ids), max_len) for ids, _ in rows)
        device = self.target.embed_tokens.weight.device
        token_ids = torch.zeros(len(rows), seq, dtype=torch.int64, device=device)
        mask = torch.zeros(len(rows), seq, dtype=torch.bool, device=device)
        for b, (ids, m) in enumerate(rows):
            n = min(len(ids), max_len)
            token_ids[b, :n] = torch.tensor(ids[:n], device=device)
            mask[b, :n] = torch.tensor(m[:n], dtype=torch.bool, device=device)
        target = self.target
        num_layers = target.config.num_layers
        target.set_aux_layer_ids((*self.aux_layer_ids, num_layers))
        positions = torch.arange(seq, device=device).repeat(len(rows))
        keys = LayerKeys(len(rows), seq, causal=True)
        with forward_context(ForwardContext(TrainingAttention(), {0: keys})):
            out = target(token_ids.reshape(-1), positions)
        states = out.aux_hidden.view(len(rows), seq, -1, target.config.hidden_size).to(dtype)  # [B, T, n, Ht]
        aux = states[:, :, :-1].flatten(2) if self.aux_layer_ids else None
        return Batch(token_ids, mask, aux, states[:, :, -1])
