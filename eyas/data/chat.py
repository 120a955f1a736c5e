"""Loss masks for chat data: train only on what the assistant says.

Render-boundary method (docs/formats.md): for assistant turn ``j``::

    prompt_j = render(messages[:j], add_generation_prompt=True)
    full_j   = render(messages[:j + 1], add_generation_prompt=False)

``full_j`` must start with ``prompt_j``; the characters ``full_j[len(prompt_j):]`` are the
assistant span, everything else of the rendered conversation is context. Worked example with a
ChatML template (no default system prompt)::

    messages = [user "Hi", assistant "Hello!"]
    prompt_1 = "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
    full_1   = prompt_1 + "Hello!<|im_end|>\\n"
    text     = full_1                      # render(messages, False)
    segments = [prompt_1 -> mask 0, "Hello!<|im_end|>\\n" -> mask 1]

So the span holds the reply, the end-of-turn token and whatever the template writes after it
(for ChatML the newline). Keeping ``<|im_end|>`` teaches the model (or drafter) to stop; the
newline after it is a fixed part of the template that costs nothing to learn, and keeping the
method free of template-specific trimming means any template works unchanged.

Tokenization is segment by segment (context, span, context, span, ..., tail), so every mask
boundary falls exactly on a token boundary. With a byte-level BPE such as SmolLM2's, this equals
``encode(text)`` whenever the special tokens sit on the boundaries and no assistant reply starts
with whitespace (the pre-tokenizer splits there anyway); tests/test_data.py checks it on real
ShareGPT chats. Where the two differ, the segmented ids are still a valid encoding of ``text``
and are the ones returned: a span that shares a token with its context cannot be masked exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Render = Callable[[list[dict[str, str]], bool], str]
Encode = Callable[[str], list[int]]


def build_loss_mask(
    render: Render, encode: Encode, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a same-length 0/1 mask of assistant tokens.

    ``render(messages, add_generation_prompt)`` returns the chat-template text; ``encode(text)``
    returns its token ids without adding BOS/EOS (the template writes the special tokens).
    ``loss_mask[i] == 1`` means token ``i`` is a training target (predicted from ids ``< i``).
    ``add_generation_prompt``: ``messages`` end with the turn a reply is to be generated for; the
    render ends with the generation prompt and may hold no assistant turn yet (a first request).
    Raises ``ValueError`` when there is no assistant turn (without ``add_generation_prompt``), an
    assistant turn comes first (nothing to condition on: drop leading assistant turns), or the
    template breaks the prefix property.
    """
    messages = list(messages)
    assistant_turns = [j for j, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistant_turns and not add_generation_prompt:
        raise ValueError(
            f"conversation has no assistant turn (roles: {[m.get('role') for m in messages]})"
        )
    if add_generation_prompt and messages and messages[-1].get("role") == "assistant":
        raise ValueError("a generation prompt follows a user (or system) turn, not an assistant turn")
    if assistant_turns and assistant_turns[0] == 0:
        raise ValueError(
            "turn 0 is an assistant turn with no prompt before it; drop leading assistant turns"
        )
    empty_ids = encode("")
    if empty_ids:
        raise ValueError(
            f"encode('') returned {empty_ids}: encode must not add special tokens (BOS/EOS)"
        )

    text = render(messages, add_generation_prompt)
    spans: list[tuple[int, int]] = []  # [start, end) character ranges of assistant spans in text
    for j in assistant_turns:
        prompt = render(messages[:j], True)
        full = render(messages[: j + 1], False)
        if not full.startswith(prompt):
            raise ValueError(
                f"turn {j}: the template's render of turns[:{j + 1}] does not start with its "
                f"generation prompt for turns[:{j}] (prompt ends {prompt[-40:]!r}, render has "
                f"{full[max(0, len(prompt) - 40) : len(prompt)]!r} there)"
            )
        if not text.startswith(full):
            raise ValueError(
                f"turn {j}: the render of turns[:{j + 1}] is not a prefix of the render of the "
                "whole conversation"
            )
        if spans and len(prompt) < spans[-1][1]:
            raise ValueError(f"turn {j}: its generation prompt overlaps the previous reply")
        if len(full) > len(prompt):  # an empty span (odd templates only) masks nothing
            spans.append((len(prompt), len(full)))

    token_ids: list[int] = []
    loss_mask: list[int] = []
    cursor = 0
    for start, end in spans + [(len(text), len(text))]:
        for segment, target in ((text[cursor:start], 0), (text[start:end], 1)):
            if segment:
                ids = encode(segment)
                token_ids += ids
                loss_mask += [target] * len(ids)
        cursor = end
    return token_ids, loss_mask
