"""``eyas regenerate``: self-distillation data without hidden states. Every reply of a conversation is
replaced by the target's own, greedy or sampled, and the conversations are written as a ``.jsonl`` file that
``eyas extract --data`` (states from one prefill per conversation) and ``eyas train --online`` (states
computed in the training loop, no dumps) read like any chat data.

Sampled replies (``temperature`` > 0, with ``top_p`` / ``top_k``; SpecForge's regeneration example samples
at 0.8) cover more of the target's distribution than its greedy path. Each reply has its own seed,
``seed * 2**32 + conversation index * 1024 + round``, so the file does not depend on the chunking, and a
resumed job writes what an uninterrupted one would.

Per conversation (sample id = its index in the data, ``000042``): optionally keep its first ``max_turns``
exchanges, drop assistant turns before the first user turn, then regenerate round by round across a chunk
of conversations: round r replaces the r-th reply of every conversation that has one, conditioned on the
regenerated replies before it (a conversation that ends with a user turn gets a reply to it too). A reply
is cut at ``max_tokens``; a conversation whose history outgrows ``max_len`` ends before that turn.

The output is its own journal: one line per conversation, written once its chunk is done,
``{"id": "000042", "conversation_id": ..., "messages": [...], "truncated": [...]}`` (``truncated``: per
reply, whether it hit ``max_tokens`` rather than ending), or ``{"id": ..., "skipped": why}``. Re-running
the same command cuts a torn last line and goes on after the journaled conversations.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from eyas.config import ModelConfig
from eyas.data.manifest import Journal, pin_settings
from eyas.data.sharegpt import Conversation, conversations, first_turns, without_leading_replies
from eyas.model.resolve import resolve_model
from eyas.sampling.params import SamplingParams

logger = logging.getLogger("eyas")


DEFAULT_MAX_LEN = 2048  # tokens of a rendered conversation a job keeps
ROUNDS = 1024  # replies a conversation can have a seed for: its seeds are seed + 0 .. seed + ROUNDS - 1


def check_counts(max_samples: int | None, max_turns: int | None) -> None:
    """The conversation counts both jobs take: None (all) or at least 1."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples: {max_samples} must be >= 1")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns: {max_turns} must be >= 1")


def reply_sampling(temperature: float, top_p: float, top_k: int, seed: int, max_tokens: int) -> dict | None:
    """The ``SamplingParams`` fields of sampled replies (None: greedy, ``temperature`` 0), checked before a model
    loads: a bad value fails here, naming the field."""
    if temperature == 0:
        return None
    if not (isinstance(seed, int) and 0 <= seed < 2**31):
        raise ValueError(f"seed: {seed!r} must be an integer in [0, 2**31)")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    SamplingParams(max_tokens=max_tokens, **sampling)
    return sampling


def conversation_seed(seed: int, sample_id: str) -> int:
    """The first seed of a conversation's replies: it depends on the job's seed and the conversation's index only,
    so a file does not depend on the chunking or on where a killed job resumed."""
    return seed * 2**32 + int(sample_id) * ROUNDS


def reply_seed(first: int, turn: int) -> int:
    """The seed of a conversation's reply ``turn`` (0 = the first reply), from its ``conversation_seed``."""
    if turn >= ROUNDS:
        raise ValueError(f"regenerate: a conversation with more than {ROUNDS} replies has no seed for the next")
    return first + turn


def regenerate_replies(llm, chats: list[Conversation], max_len: int, max_tokens: int, *, last: bool = True,
                       sampling: dict | None = None, seeds: list[int] | None = None,
                       ) -> tuple[list[Conversation], list[list[bool]]]:
    """The conversations with their replies replaced by the target's own (up to ``max_tokens``), and per
    conversation whether each regenerated reply was cut at ``max_tokens``.

    Greedy, or with ``sampling`` (``SamplingParams`` fields: temperature, top_p, top_k) and ``seeds`` (one per
    conversation; its reply of round r is drawn with seed ``seeds[i] + r``). ``last=False``: the last reply is
    dropped instead of regenerated, so each conversation ends with the turn that reply answers (``eyas
    extract`` generates that one itself, dumping its states). Round r regenerates the r-th reply of every
    conversation that has one, in one batch, conditioned on the regenerated history; a history of
    ``max_len - 1`` tokens or more ends the conversation before that turn.
    """
    tok = llm.get_tokenizer()
    settings = dict(max_tokens=max_tokens, speculate=False, detokenize=False, **(sampling or {"temperature": 0}))
    history, cut = [], []
    for chat in chats:
        messages = list(chat.messages)
        if messages and messages[-1]["role"] == "assistant" and not last:
            messages.pop()
        elif messages and messages[-1]["role"] != "assistant" and last:
            messages.append({"role": "assistant", "content": ""})  # a reply to the final user turn
        history.append(messages)
        cut.append([])
    for r in itertools.count():
        batch, prompts, params = [], [], []
        for i, messages in enumerate(history):
            replies = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            if r >= len(replies):
                continue
            j = replies[r]
            ids = tok.encode(tok.apply_chat_template(messages[:j], add_generation_prompt=True),
                             add_special_tokens=False)
            if len(ids) >= max_len - 1:
                history[i] = messages[:replies[r - 1] + 1] if r and last else messages[:replies[r - 1] if r else j]
                continue
            batch.append((i, j))
            prompts.append(ids)
            params.append(SamplingParams(**settings, seed=None if seeds is None else reply_seed(seeds[i], r)))
        if not batch:
            break
        for (i, j), out in zip(batch, llm.generate(prompts, params, use_tqdm=False)):
            history[i][j] = {"role": "assistant", "content": tok.decode(out.outputs[0].token_ids)}
            cut[i].append(out.outputs[0].finish_reason == "length")
    return [Conversation(c.id, h) for c, h in zip(chats, history)], cut


def run_regenerate(data: str, out: str | Path, *, model: str | None = None, max_samples: int | None = None,
                   max_turns: int | None = None, max_tokens: int = 512, max_len: int | None = None,
                   chunk_size: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   seed: int = 0, progress: bool = True, **llm_kwargs) -> dict:
    """Run (or resume) the job; returns counts. ``out`` is the ``.jsonl`` file (its settings are pinned in
    ``<out>.job.json``); greedy unless ``temperature`` > 0 (then ``top_p``, ``top_k`` and ``seed`` apply);
    ``llm_kwargs`` go to ``LLM``."""
    from eyas.llm import LLM

    out = Path(out)
    if out.suffix != ".jsonl":
        raise ValueError(f"out: '{out}' must name a .jsonl file (the regenerated conversations)")
    check_counts(max_samples, max_turns)
    if max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens} must be >= 1")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: {chunk_size} must be >= 1")
    sampling = reply_sampling(temperature, top_p, top_k, seed, max_tokens)
    if max_len is None:
        max_len = min(DEFAULT_MAX_LEN, ModelConfig.from_folder(resolve_model(model)).max_position_embeddings)
    llm = LLM(model, max_model_len=max_len, **llm_kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    job = out.with_name(out.name + ".job.json")
    settings = {"format": "eyas-regenerated/1", "data": data, "model": llm.engine.config.model.path.name,
                "max_turns": max_turns, "max_tokens": max_tokens, "max_len": max_len,
                "dtype": str(llm.engine.config.dtype).removeprefix("torch."),
                "sampling": None if sampling is None else {**sampling, "seed": seed}}
    pin_settings(job, settings, f"out: {out} was written with other settings ({{changed}} differ); resume with "
                 "the same settings or write another file")
    journal = Journal(out)
    done = journal.read()
    todo = ((f"{i:06d}", c) for i, c in enumerate(itertools.islice(conversations(data), max_samples)))
    todo = ((sid, first_turns(without_leading_replies(c), max_turns)) for sid, c in todo if sid not in done)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(1 for _ in itertools.islice(conversations(data), max_samples))
        bar = tqdm(total=total, initial=min(total, len(done)), desc="regenerate", unit="conv", dynamic_ncols=True)
    counts = {"written": 0, "skipped": 0, "replies": 0, "truncated": 0}
    start = time.perf_counter()
    while chunk := list(itertools.islice(todo, chunk_size)):
        usable = [(sid, c) for sid, c in chunk if any(m["role"] == "user" for m in c.messages)]
        seeds = None if sampling is None else [conversation_seed(seed, sid) for sid, _ in usable]
        chats, cut = regenerate_replies(llm, [c for _, c in usable], max_len, max_tokens, sampling=sampling, seeds=seeds)
        regenerated = {sid: (chat, flags) for (sid, _), chat, flags in zip(usable, chats, cut)}
        entries = []
        for sid, conversation in chunk:
            chat, flags = regenerated.get(sid, (None, []))
            if not flags:
                why = "no user turn" if chat is None else f"the first prompt does not fit in {max_len} tokens"
                entries.append({"id": sid, "conversation_id": conversation.id, "skipped": why})
                continue
            entries.append({"id": sid, "conversation_id": conversation.id, "messages": chat.messages,
                            "truncated": flags})
        journal.append(entries)
        for e in entries:
            counts["skipped" if "skipped" in e else "written"] += 1
            counts["replies"] += len(e.get("truncated", ()))
            counts["truncated"] += sum(e.get("truncated", ()))
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix_str(f"{counts['replies'] / (time.perf_counter() - start):.1f} replies/s")
    if bar is not None:
        bar.close()
    logger.info("regenerate: %d conversations written (%d skipped, %d replies, %d cut at max_tokens) to %s",
                counts["written"], counts["skipped"], counts["replies"], counts["truncated"], out)
    return counts
