"""Hidden-state extraction vs plain prefill of the same engine, in one run.

The first N usable ShareGPT conversations are rendered with the model's chat template (whole
conversations, cut to ``--max-len`` tokens). The same token ids then run twice through eyas with
``max_tokens=1`` (a prefill plus one sampled token each):

* plain: ``LLM(...)`` without speculation;
* extract: ``LLM(..., speculative_config={"method": "extract_hidden_states", ...})``, which also
  writes ``{request_id}.safetensors`` per conversation; the timed span ends when every file is on
  disk (``generate`` returns only then).

Prints prompt tokens/s of each and the overhead ``1 - extract / plain`` (goal: at most 15%), the
bytes written per token against the exact ``num_layers * hidden * dtype bytes`` (+ 8 for the int64
token id), and the peak resident memory of each phase (``VmHWM``, reset between phases).
Prefix caching is off in both so the shared system prompt does not skip work in one but not in
the other's accounting.

    python benchmarks/bench_extract.py                       # 512 conversations, max_len 256
    python benchmarks/bench_extract.py --num-conversations 64 --max-len 512   # quick check
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.chat import build_loss_mask
from eyas.data.extract import default_layer_ids
from eyas.data.sharegpt import iter_sharegpt
from eyas.model.resolve import resolve_model


def _peak_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


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


def _timed(llm: LLM, prompts: list[list[int]]) -> float:
    llm.generate(prompts[:4], SamplingParams(max_tokens=1, speculate=False), use_tqdm=False)  # warm-up, no dump
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-conversations", type=int, default=512)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--layers", default=None, help="aux layer ids (default 2,N//2,N-3)")
    p.add_argument("--out", default=None, help="folder for the files (default: a temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_folder(resolve_model(args.model))
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(default_layer_ids(cfg.num_layers))
    common = dict(dtype=args.dtype, max_model_len=args.max_len, enable_prefix_caching=False, kv_cache_gb=1.0,
                  max_num_batched_tokens=2048)
    print("command:", shlex.join(["python", *sys.argv]))

    plain = LLM(args.model, **common)
    prompts = _prompts(plain, args.num_conversations, args.max_len)
    num_tokens = sum(map(len, prompts))
    print(f"{len(prompts)} conversations, {num_tokens} tokens (mean {num_tokens / len(prompts):.0f}, "
          f"max {max(map(len, prompts))}), {cfg.path.name}, {args.dtype}, {args.threads} threads, layers {layers}")
    _peak_reset()
    plain_s = _timed(plain, prompts)
    plain_peak = _peak_mb()
    del plain
    gc.collect()

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        _peak_reset()
        extract = LLM(args.model, **common, speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1, "aux_layer_ids": layers,
            "output_dir": str(out)})
        extract_s = _timed(extract, prompts)
        extract_peak = _peak_mb()
        files = list(out.glob("*.safetensors"))
        written = sum(f.stat().st_size for f in files)

    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    exact = len(layers) * cfg.hidden_size * itemsize
    plain_tps, extract_tps = num_tokens / plain_s, num_tokens / extract_s
    print(f"plain prefill : {plain_tps:8.0f} tok/s  ({plain_s:.1f} s)   peak RSS {plain_peak:.0f} MB")
    print(f"extraction    : {extract_tps:8.0f} tok/s  ({extract_s:.1f} s)   peak RSS {extract_peak:.0f} MB "
          f"(model loaded again; files written on 2 threads)")
    print(f"overhead      : {1 - extract_tps / plain_tps:+.1%} (goal: at most 15%)")
    print(f"bytes/token   : {written / num_tokens:.1f} written vs {exact} exact hidden states "
          f"({len(layers)} x {cfg.hidden_size} x {itemsize} B) + 8 token id = {exact + 8}; "
          f"ratio {written / num_tokens / (exact + 8):.4f} ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
