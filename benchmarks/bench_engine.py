"""eyas vs Hugging Face transformers ``generate``, timed in one process, plus a bandwidth bound.

For each batch size B the first B real chat prompts (ShareGPT openings rendered with the
model's chat template) are run greedily for the same number of new tokens by both engines:

* eyas: ``llm.generate(prompts[:B], SamplingParams(temperature=0, ignore_eos=True))``;
* HF: ``model.generate`` on the same token ids, batched with left padding and an attention
  mask, ``do_sample=False``, ``min_new_tokens == max_new_tokens`` so both make the same count.

Each side gets one untimed warm-up call at that B on other prompts (a few tokens), then one
timed call;
tokens/s = generated tokens / wall time of the call (prefill included). The ratio eyas/HF is
what matters: absolute numbers on a shared machine mean little.

Then the batch-1 decode step of eyas is compared to the memory-bandwidth bound: a decode step
must read every weight once, so it cannot beat ``weight bytes / bandwidth``, with the bandwidth
measured here by a large tensor copy.

``--sampling model-defaults`` samples instead, both engines with the model's own sampling settings (its
generation config, or the built-in model's card: ``LLM.get_default_sampling_params``), what a user gets
without choosing: HF ``do_sample=True`` with the same temperature, top-p, top-k and repetition penalty.
The outputs then differ (each engine has its own random numbers), so none are compared.

    python benchmarks/bench_engine.py                      # fp32, B = 1,8,32, 128 tokens
    python benchmarks/bench_engine.py --batch-sizes 1,8 --max-tokens 32
    python benchmarks/bench_engine.py --sampling model-defaults --batch-sizes 1,16
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import batch_sizes

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.prompts import chat_prompts
from eyas.model.resolve import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REFERENCE_BW_GBS = 40.0  # the project's reference machine for the 150 steps/s bf16 figure
COPY_MB = 512
WARMUP_TOKENS = 8  # a warm-up call runs the same shapes of prefill and decode, just fewer steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: built-in SmolLM2-135M)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads for eyas and HF alike")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8,32", help="comma-separated, e.g. 1,8,32")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--hf-max-tokens", type=int, default=None,
                   help="new tokens per prompt for HF only (default: --max-tokens); HF tok/s is "
                        "then measured on fewer tokens and the match check covers that many")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts loaded (default: max batch size)")
    p.add_argument("--decode-reps", type=int, default=3, help="batch-1 requests for the decode step time")
    p.add_argument("--skip-hf", action="store_true", help="time eyas only")
    p.add_argument("--sampling", choices=["greedy", "model-defaults"], default="greedy",
                   help="greedy, or both engines sampling with the model's default settings")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads {args.threads}: must be >= 1")
    if args.max_tokens < 2:
        p.error(f"--max-tokens {args.max_tokens}: must be >= 2 (decode time needs two tokens)")
    args.hf_max_tokens = args.hf_max_tokens or args.max_tokens
    if not 1 <= args.hf_max_tokens <= args.max_tokens:
        p.error(f"--hf-max-tokens {args.hf_max_tokens}: must be in [1, --max-tokens={args.max_tokens}]")
    args.num_prompts = args.num_prompts or max(args.batch_sizes)
    if args.num_prompts < max(args.batch_sizes):
        p.error(f"--num-prompts {args.num_prompts}: must be >= the largest batch size {max(args.batch_sizes)}")
    return args


def cpu_bf16_note() -> str:
    """Whether this CPU has native bf16 math (AVX512-BF16 or AMX); without it bf16 is emulated."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "CPU flags unknown"
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return f"CPU has native bf16 ({', '.join(native)})"
    return "CPU has NO native bf16 (no avx512_bf16/amx_bf16): bf16 matmuls are emulated and slow"


def copy_bandwidth_gbs(mb: int = COPY_MB, reps: int = 5) -> tuple[float, float]:
    """Best-of-``reps`` ``dst.copy_(src)`` on an ``mb`` MB float32 tensor: (bytes/time, time).

    A copy reads ``mb`` MB and writes ``mb`` MB, so memory traffic is at least 2x bytes/time;
    we report bytes/time as the *read* bandwidth, a conservative stand-in for how fast a decode
    step can stream weights (a decode step reads weights and writes almost nothing).
    """
    n = mb * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault in the pages
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best / 1e9, best


def weight_bytes_per_step(model_path: Path, dtype: torch.dtype) -> tuple[int, int]:
    """(parameter count, bytes) a decode step reads: every weight once, in ``dtype``.

    The embedding lookup touches only B rows; with tied embeddings the same table is read whole
    as the lm_head, so it is counted once (a checkpoint of a tied model stores it once; a stray
    ``lm_head.weight`` beside a tied table is skipped).
    """
    import json

    from safetensors import safe_open

    tied = json.loads((model_path / "config.json").read_text()).get("tie_word_embeddings", False)
    count = 0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if tied and name.endswith("lm_head.weight"):
                    continue
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                count += numel
    return count, count * torch.tensor([], dtype=dtype).element_size()


def render_prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chat_prompts(n)]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def eyas_params(llm: LLM, sampling: str, max_tokens: int) -> SamplingParams:
    base = SamplingParams(temperature=0) if sampling == "greedy" else llm.get_default_sampling_params()
    return dataclasses.replace(base, max_tokens=max_tokens, ignore_eos=True)


def hf_sampling(params: SamplingParams) -> dict:
    """HF ``generate`` arguments drawing from the distribution ``params`` describes."""
    if params.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "repetition_penalty": params.repetition_penalty}


def time_eyas(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    max_tokens = params.max_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == max_tokens for t in ids), "ignore_eos run stopped early"
    return sum(map(len, ids)) / elapsed, ids


def time_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int,
            sampling: dict) -> tuple[float, list[list[int]]]:
    """Batched ``generate`` (``sampling``: ``hf_sampling``) with left padding; returns (tokens/s, new token ids)."""
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, use_cache=True, pad_token_id=pad_id, **sampling)
    elapsed = time.perf_counter() - t0
    new = out[:, width:]  # [B, max_tokens]
    assert new.shape[1] == max_tokens, f"HF made {new.shape[1]} tokens, asked for {max_tokens}"
    return new.numel() / elapsed, new.tolist()


def count_matches(eyas_ids: list[list[int]], hf_ids: list[list[int]], eos: set[int]) -> int:
    """Outputs identical over HF's length, compared up to eyas's first EOS.

    HF's ``min_new_tokens`` forbids EOS while eyas's ``ignore_eos`` emits it and carries on,
    so the two legitimately part ways at the first EOS; everything before it must agree.
    """
    same = 0
    for a, b in zip(eyas_ids, hf_ids):
        n = len(b)
        for i, t in enumerate(a[:n]):
            if t in eos:
                n = i
                break
        same += a[:n] == b[:n]
    return same


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}; {cpu_bf16_note()}")

    bw, copy_s = copy_bandwidth_gbs()
    print(f"copy bandwidth: {COPY_MB} MB dst.copy_(src) best of 5 in {copy_s * 1e3:.1f} ms -> "
          f"read {bw:.1f} GB/s (bytes/time; the copy also writes as many bytes, so total traffic is ~2x)")

    model_path = resolve_model(args.model)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
              max_num_seqs=max(64, max(args.batch_sizes)), enable_prefix_caching=False)
    prompts = render_prompts(llm, args.num_prompts + max(args.batch_sizes))
    measured, warmup = prompts[: args.num_prompts], prompts[args.num_prompts:]
    eos = set(ModelConfig.from_folder(model_path).eos_token_ids)

    hf = None
    if not args.skip_hf:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        pad_id = hf.generation_config.eos_token_id
        pad_id = (pad_id[0] if isinstance(pad_id, list) else pad_id) or 0
    print(f"model {model_path}; prompts: first {args.num_prompts} chat prompts "
          f"({min(map(len, measured))}-{max(map(len, measured))} tokens), warm-up on the next ones; "
          f"eyas prefix caching off (equal work); {args.max_tokens} new tokens"
          + ("" if args.hf_max_tokens == args.max_tokens else f" (HF: {args.hf_max_tokens})"))
    params = eyas_params(llm, args.sampling, args.max_tokens)
    sampling = hf_sampling(params)
    print(f"sampling: {args.sampling}: temperature {params.temperature}, top_p {params.top_p}, top_k {params.top_k}, "
          f"repetition penalty {params.repetition_penalty}")

    print(f"\n{'B':>4} {'eyas tok/s':>11} {'HF tok/s':>10} {'eyas/HF':>8} {'identical':>10}")
    for b in args.batch_sizes:
        time_eyas(llm, warmup[:b], dataclasses.replace(params, max_tokens=WARMUP_TOKENS))
        eyas_tps, eyas_ids = time_eyas(llm, measured[:b], params)
        if hf is None:
            print(f"{b:>4} {eyas_tps:>11.1f} {'-':>10} {'-':>8} {'-':>10}", flush=True)
            continue
        time_hf(hf, warmup[:b], WARMUP_TOKENS, pad_id, sampling)
        hf_tps, hf_ids = time_hf(hf, measured[:b], args.hf_max_tokens, pad_id, sampling)
        same = f"{count_matches(eyas_ids, hf_ids, eos)}/{b}" if params.greedy else "-"
        print(f"{b:>4} {eyas_tps:>11.1f} {hf_tps:>10.1f} {eyas_tps / hf_tps:>7.2f}x {same:>10}", flush=True)
    print("tok/s = generated tokens / wall time of one generate call (prefill included); identical = "
          "greedy outputs equal token for token (up to eyas's first EOS, which HF's min_new_tokens forbids)")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tpots = [llm.generate([p], params, use_tqdm=False)[0].metrics.time_per_output_token
             for p in measured[: args.decode_reps]]
    step = statistics.median(tpots)
    count, nbytes = weight_bytes_per_step(model_path, dtype)
    bound = nbytes / (bw * 1e9)
    print(f"\ndecode step at batch 1 (median time_per_output_token of {len(tpots)} requests): "
          f"{step * 1e3:.2f} ms = {1 / step:.0f} steps/s")
    print(f"weights read per step: {count / 1e6:.1f}M params x {nbytes // count} B = {nbytes / 1e6:.0f} MB "
          f"(tied embedding counted once, as lm_head)")
    print(f"bandwidth bound: {nbytes / 1e6:.0f} MB / {bw:.1f} GB/s = {bound * 1e3:.2f} ms = {1 / bound:.0f} steps/s; "
          f"eyas reaches {bound / step:.0%} of it (bound / measured)")
    ref_bytes = count * 2
    print(f"reference: bf16 weights {ref_bytes / 1e6:.0f} MB / {REFERENCE_BW_GBS:.0f} GB/s = "
          f"{ref_bytes / (REFERENCE_BW_GBS * 1e9) * 1e3:.2f} ms = {REFERENCE_BW_GBS * 1e9 / ref_bytes:.0f} steps/s "
          f"(the project's reference figure of ~150 steps/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
