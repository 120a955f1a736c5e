"""``eyas extract``: a resumable job that turns chat data into hidden-state training files.

Per conversation (sample id = its index in the data file, ``000042``):

0. optionally keep only its first ``max_turns`` exchanges (user turn and reply);
1. render it with the chat template and build the assistant-only loss mask (render-boundary
   method, ``eyas.data.chat``), cut to ``max_len - 1`` tokens;
2. extract: it runs through the engine with ``extract_hidden_states`` at full batch, which writes
   ``{sample_id}.safetensors`` (``hidden_states [num_tokens, num_layers, hidden]``, ``token_ids
   [num_tokens]``) atomically on writer threads;
3. once the files of a chunk are on disk, their journal lines are appended (``samples.jsonl``).

With ``regenerate`` (self-distillation) the replies are the target's own, greedy, up to
``regen_max_tokens``: every assistant turn but the last is regenerated first, as text, each
conditioned on the regenerated history; the last one is generated in step 2 itself, from the
rendered history with the generation prompt, and the states of prompt and reply are dumped by
that same forward (the reply's token ids are the ones the target produced; its final token,
never fed back, has no state and is left out). One forward per token, no second pass.

Re-running the same command skips journaled samples, cuts a torn journal line, deletes stale
temporary files and redoes samples whose files were never journaled. The manifest
(``manifest.json``) is rebuilt at the end. ``job.json`` pins the settings: resuming with a
different model, layers or rendering is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.config import ModelConfig
from eyas.data.chat import build_loss_mask
from eyas.data.hidden_states_writer import TMP_SUFFIX
from eyas.data.manifest import Journal, build_manifest, mask_to_runs, pin_settings, write_json_atomic
from eyas.data.sharegpt import Conversation, conversations, first_turns, without_leading_replies
from eyas.jobs.regenerate import DEFAULT_MAX_LEN, check_counts, conversation_seed, regenerate_replies, reply_sampling, reply_seed
from eyas.model.resolve import resolve_model
from eyas.sampling.params import SamplingParams
from eyas.spec_decode.extract_hidden_states import LAYER_CONVENTION

logger = logging.getLogger("eyas")


@dataclass
class Sample:
    sample_id: str
    conversation: Conversation
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    skipped: str | None = None  # why the sample cannot be used


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The EAGLE-3 default (vLLM convention): low, middle and high streams."""
    return (2, num_layers // 2, num_layers - 3)


def model_identity(cfg: ModelConfig) -> dict:
    digest = hashlib.blake2b(digest_size=8)
    digest.update((cfg.path / "config.json").read_bytes())
    for file in sorted(cfg.path.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            digest.update(f"{file.name}:{size}".encode() + f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())
    return {"path": str(cfg.path), "name": cfg.path.name, "architecture": cfg.architecture,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "fingerprint": digest.hexdigest()}


def run_extract(data: str, out: str | Path, *, model: str | None = None, layers: list[int] | None = None,
                regenerate: bool = False, max_samples: int | None = None, max_len: int | None = None,
                max_turns: int | None = None, regen_max_tokens: int = 512, chunk_size: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                progress: bool = True, **llm_kwargs) -> dict:
    """Run (or resume) the job; returns the manifest. ``max_len`` defaults to 2048 or the model's limit if
    lower. With ``regenerate``, replies are greedy unless ``temperature`` > 0 (then ``top_p``, ``top_k`` and
    ``seed`` apply, as in ``eyas regenerate``). ``llm_kwargs`` go to ``LLM`` (dtype, num_threads, kv_cache_gb, ...)."""
    from eyas.llm import LLM

    check_counts(max_samples, max_turns)
    if regen_max_tokens < 2:
        raise ValueError(f"regen_max_tokens: {regen_max_tokens} must be >= 2 (a reply's last token has no state)")
    if temperature != 0 and not regenerate:
        raise ValueError(f"temperature: {temperature} samples regenerated replies; add regenerate (--regenerate)")
    sampling = reply_sampling(temperature, top_p, top_k, seed, regen_max_tokens)
    cfg = ModelConfig.from_folder(resolve_model(model))
    max_len = max_len or min(DEFAULT_MAX_LEN, cfg.max_position_embeddings)
    if max_len < 16:
        raise ValueError(f"max_len: {max_len} must be >= 16")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = tuple(layers) if layers else default_layer_ids(cfg.num_layers)
    llm = LLM(model, max_model_len=max_len, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1, "aux_layer_ids": list(layer_ids),
        "output_dir": str(out), "include_output_tokens": True}, **llm_kwargs)
    header = {"format": "eyas-hidden-states/1", "model": model_identity(cfg), "aux_layer_ids": list(layer_ids),
              "layer_convention": LAYER_CONVENTION,
              "layer_convention_doc": "id k = the residual stream entering decoder layer k (0 = embeddings, "
                                      f"{cfg.num_layers} = after the last layer, before the final norm)",
              "dtype": str(llm.engine.config.dtype).removeprefix("torch."), "hidden_size": cfg.hidden_size,
              "num_layers": len(layer_ids), "max_len": max_len, "max_turns": max_turns, "regenerate": regenerate,
              "regen_max_tokens": regen_max_tokens if regenerate else None,
              "sampling": None if sampling is None else {**sampling, "seed": seed},
              "files": {"hidden_states": "[num_tokens, num_layers, hidden_size]", "token_ids": "[num_tokens] int64"}}
    _pin_job(out / "job.json", header)
    for stale in out.glob(f".*{TMP_SUFFIX}"):
        stale.unlink()
    journal = Journal(out / "samples.jsonl")
    done = journal.read()
    todo = (Sample(f"{i:06d}", first_turns(without_leading_replies(c), max_turns))
            for i, c in enumerate(itertools.islice(conversations(data), max_samples)))
    todo = (s for s in todo if s.sample_id not in done)
    num_conversations = sum(1 for _ in itertools.islice(conversations(data), max_samples))  # a few s for ShareGPT
    total = num_conversations - sum(1 for sample_id in done if int(sample_id) < num_conversations)
    bar = _progress(total, len(done)) if progress else None
    num_tokens, start = 0, time.perf_counter()
    while chunk := list(itertools.islice(todo, chunk_size)):
        if regenerate:
            _regenerate(llm, chunk, max_len, regen_max_tokens, sampling, seed)
        for sample in chunk:
            _render(llm, sample, max_len, reply=regenerate)
        entries = _extract(llm, [s for s in chunk if s.skipped is None], out, regen_max_tokens if regenerate else 1,
                           sampling, seed)
        entries += [{"id": s.sample_id, "conversation_id": s.conversation.id, "skipped": s.skipped}
                    for s in chunk if s.skipped is not None]
        journal.append(entries)
        num_tokens += sum(e.get("num_tokens", 0) for e in entries)
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - start):.0f} tok/s")
    if bar is not None:
        bar.close()
    manifest = build_manifest(out, header, journal.read())
    write_json_atomic(out / "manifest.json", manifest)
    logger.info("extract: %d samples (%d skipped), %d tokens, in %s", manifest["num_samples"],
                manifest["num_skipped"], manifest["num_tokens"], out)
    return manifest


def _pin_job(path: Path, header: dict) -> None:
    pin_settings(path, {k: v for k, v in header.items() if k != "files"},
                 f"out: {path.parent} holds a job with other settings ({{changed}} differ); resume with the same "
                 "settings or use a new folder")


def _progress(total: int, num_done: int):
    from tqdm import tqdm

    if num_done:
        logger.info("extract: resuming, %d samples already done", num_done)
    return tqdm(total=total, desc="extract", unit="sample", dynamic_ncols=True)


def _render(llm, sample: Sample, max_len: int, reply: bool) -> None:
    """Token ids and assistant-only loss mask of the conversation (``reply``: of the history a reply is to be
    generated for, ending with the generation prompt)."""
    if sample.skipped is not None:
        return
    tok = llm.get_tokenizer()
    messages = sample.conversation.messages
    try:
        ids, mask = build_loss_mask(lambda m, gen: tok.apply_chat_template(m, add_generation_prompt=gen),
                                    lambda text: tok.encode(text, add_special_tokens=False), messages, reply)
    except ValueError as error:
        sample.skipped = str(error)
        return
    if reply:
        if not any(m["role"] == "user" for m in messages):
            sample.skipped = "no user turn to reply to"
        elif len(ids) >= max_len - 1:
            sample.skipped = f"the prompt of the last reply has {len(ids)} tokens, no room for a reply in {max_len}"
        if sample.skipped:
            return
    else:
        ids, mask = ids[:max_len - 1], mask[:max_len - 1]  # room for the one token the engine samples
        if not any(mask):
            sample.skipped = f"no assistant token within the first {max_len - 1} tokens"
            return
    sample.token_ids, sample.loss_mask = ids, mask


def _extract(llm, samples: list[Sample], out: Path, max_tokens: int, sampling: dict | None,
             seed: int) -> list[dict]:
    """Run every sample with extraction on, generating up to ``max_tokens`` greedily, or with ``sampling`` and the
    reply's seed (1: a prefill); journal entries once their files are on disk. The generated tokens but the last
    are dumped too, as loss tokens."""

    engine = llm.engine
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    for sample in samples:
        if sampling is None:
            params = greedy
        else:  # the reply after the sample's regenerated ones
            turn = sum(m["role"] == "assistant" for m in sample.conversation.messages)
            params = SamplingParams(max_tokens=max_tokens, **sampling,
                                    seed=reply_seed(conversation_seed(seed, sample.sample_id), turn))
        engine.add_request(sample.sample_id, sample.token_ids, params, stream=False)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    engine.flush()
    entries = []
    for s in samples:
        output = outputs[s.sample_id]
        reply = len(output.outputs[0].token_ids) - 1  # tokens fed back: dumped with their states
        mask = s.loss_mask + [1] * reply
        file = Path(output.hidden_states_path).name
        if not any(mask):
            (out / file).unlink()
            entries.append({"id": s.sample_id, "conversation_id": s.conversation.id,
                            "skipped": "the regenerated reply is one token, with no state to train on"})
            continue
        entries.append({"id": s.sample_id, "conversation_id": s.conversation.id, "file": file,
                        "num_tokens": len(s.token_ids) + reply, "num_loss_tokens": sum(mask),
                        "loss_mask_runs": mask_to_runs(mask)})
    return entries


def _regenerate(llm, samples: list[Sample], max_len: int, max_tokens: int, sampling: dict | None, seed: int) -> None:
    """Replace every assistant turn but the last by the target's own reply (greedy, or with ``sampling``) and end
    each conversation with the turn its last reply answers (``_extract`` generates that one, dumping its states)."""

    seeds = None if sampling is None else [conversation_seed(seed, s.sample_id) for s in samples]
    chats, _ = regenerate_replies(llm, [s.conversation for s in samples], max_len, max_tokens, last=False,
                                  sampling=sampling, seeds=seeds)
    for sample, chat in zip(samples, chats):
        sample.conversation = chat
