"""Hidden-state extraction vs plain prefill of the same engine, in one run.

The first N usable ShareGPT conversations are rendered with the model's chat template (whole
conversations, cut to ``--max-len`` tokens). The same token ids then run twice through eyas with
``max_tokens=1`` (a prefill plus one sampled token each):

* plain: ``LLM(...)`` without speculation;
* extract: ``LLM(..., speculative_config={"method": "extract_hidden_states", ...})``, which also
  writes ``{request_id}.safetensors`` per conversation; the timed span ends when every file is on
  disk (``generate`` returns only then).

Both engines are loaded at once and take turns on chunks of conversations (alternating which goes
first), so drift in the shared machine's speed hits both alike. Prints prompt tokens/s of each and
the overhead ``1 - extract / plain`` (goal: at most 15%), the bytes written per token against the
exact ``num_layers * hidden * dtype bytes`` (+ 8 for the int64 token id), the peak resident memory
of the process and the part of the extraction engine's KV budget that holds hidden states.
Prefix caching is off in both so the shared system prompt does not skip work in one but not in
the other's accounting.

    python benchmarks/bench_extract.py                       # 512 conversations, max_len 256
    python benchmarks/bench_extract.py --num-conversations 64 --max-len 512   # quick check
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.chat import build_loss_mask
from eyas.data.sharegpt import iter_sharegpt
from eyas.jobs.extract import default_layer_ids
from eyas.model.resolve import resolve_model


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _prompts(llm: LLM, n: int, max_len: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    prompts = []
    for conv in iter_sharegpt():
        messages = conv.messages
        while messages and messages[0]["role"] == "assistant":
            messages = messages[1:]
        try:
            ids, _ = build_loss_mask(lambda m, g: tok.apply_chat_template(m, add_generation_prompt=g),
                                     lambda t: tok.encode(t, add_special_tokens=False), messages)
        except ValueError:
            continue
        prompts.append(ids[:max_len - 1])
        if len(prompts) == n:
            return prompts
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-conversations", type=int, default=512)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64, help="conversations per timed call (the engines alternate)")
    p.add_argument("--layers", default=None, help="aux layer ids (default 2,N//2,N-3)")
    p.add_argument("--out", default=None, help="folder for the files (default: a temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_folder(resolve_model(args.model))
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(default_layer_ids(cfg.num_layers))
    common = dict(dtype=args.dtype, max_model_len=args.max_len, enable_prefix_caching=False, kv_cache_gb=1.0,
                  max_num_batched_tokens=2048)
    print("command:", shlex.join(["python", *sys.argv]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        plain = LLM(args.model, **common)
        prompts = _prompts(plain, args.num_conversations, args.max_len)
        num_tokens = sum(map(len, prompts))
        print(f"{len(prompts)} conversations, {num_tokens} tokens (mean {num_tokens / len(prompts):.0f}, "
              f"max {max(map(len, prompts))}), {cfg.path.name}, {args.dtype}, {args.threads} threads, layers {layers}")
        extract = LLM(args.model, **common, speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1, "aux_layer_ids": layers,
            "output_dir": str(out)})
        for llm in (plain, extract):  # warm-up, not dumped
            llm.generate(prompts[:4], SamplingParams(max_tokens=1, speculate=False), use_tqdm=False)
        elapsed = {"plain": 0.0, "extract": 0.0}
        params = SamplingParams(max_tokens=1, temperature=0)
        for i in range(0, len(prompts), args.chunk):  # alternate, so drift in machine speed hits both alike
            chunk = prompts[i:i + args.chunk]
            order = [("plain", plain), ("extract", extract)]
            for name, llm in order if (i // args.chunk) % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                llm.generate(chunk, params, use_tqdm=False)  # returns once the chunk's files are on disk
                elapsed[name] += time.perf_counter() - start
        peak = _peak_mb()
        files = list(out.glob("*.safetensors"))
        written = sum(f.stat().st_size for f in files)
        hidden_group = extract.engine.num_kv_blocks * extract.engine.config.cache.block_size * \
            extract.engine.runner.proposer.layer.bytes_per_token(extract.engine.config.dtype)

    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    exact = len(layers) * cfg.hidden_size * itemsize
    plain_tps, extract_tps = num_tokens / elapsed["plain"], num_tokens / elapsed["extract"]
    print(f"plain prefill : {plain_tps:8.0f} tok/s  ({elapsed['plain']:.1f} s)")
    print(f"extraction    : {extract_tps:8.0f} tok/s  ({elapsed['extract']:.1f} s, files written on 2 threads)")
    print(f"overhead      : {1 - extract_tps / plain_tps:+.1%} (goal: at most 15%)")
    print(f"bytes/token   : {written / num_tokens:.1f} written vs {exact} exact hidden states "
          f"({len(layers)} x {cfg.hidden_size} x {itemsize} B) + 8 token id = {exact + 8}; "
          f"ratio {written / num_tokens / (exact + 8):.4f} ({len(files)} files)")
    print(f"peak RSS      : {peak:.0f} MB for both engines (each: weights + a 1 GiB KV budget); extraction's own "
          f"share of its KV budget (the hidden-state group): {hidden_group / 2**20:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
