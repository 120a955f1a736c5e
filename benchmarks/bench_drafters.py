"""Cost of one draft step of each hidden-state drafter relative to one target decode step.

Random drafters (EAGLE-1, EAGLE-3 with a 16k draft vocabulary, MTP with one layer) are built for
the target and saved in their public layouts. For each batch size B the same B ShareGPT chat
prompts are generated greedily (``--max-tokens`` new tokens, EOS ignored):

* plain: the target decode step = median ``time_per_output_token`` of the requests;
* each method with k drafts: the time inside the proposer per step (draft prefill over the
  verification layout plus k-1 draft decode steps) divided by k = one draft step.

The ratio draft step / target decode step is the overhead a trained drafter must beat: with
acceptance length L, speculation pays when ``L > (verify step + k * draft step) / decode step``.
Random drafters accept almost nothing; this measures cost, not speedup.

    python benchmarks/bench_drafters.py                         # B = 1,8, k = 3, 1 thread
    python benchmarks/bench_drafters.py --threads 2 --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import batch_sizes

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.data.prompts import chat_prompts
from eyas.model.drafters import Eagle1Drafter, Eagle3Drafter, MtpDrafter, TargetParts, save_drafter
from eyas.model.loader import load_model
from eyas.model.resolve import resolve_model


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--export", default=None,
                   help="also keep the drafters and write prompts.json here (for peer_vllm.py --spec-model)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = args.batch_sizes
    target_path = resolve_model(args.model)
    print("command:", shlex.join(["python", *sys.argv]))
    common = dict(dtype="float32", max_model_len=1024, kv_cache_gb=0.5, enable_prefix_caching=False)
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
        print(f"target decode step (SmolLM2-135M fp32, {args.threads} thread(s)): "
              + ", ".join(f"B={b}: {decode[b] * 1e3:.1f} ms ({plain_tps[b]:.1f} tok/s)" for b in sizes))
        print(f"{'method':8s} {'B':>3s} {'draft step':>11s} {'/ decode':>9s} {'propose/step':>13s} "
              f"{'tok/s':>7s} {'vs plain':>9s} {'accepted':>9s}")
        for name, spec in methods.items():
            target = spec.pop("target", str(target_path))
            llm = LLM(target, **common, speculative_config={**spec, "num_speculative_tokens": args.k,
                                                            "adaptive_draft_length": False})
            proposer = llm.engine.runner.proposer
            timings: list[float] = []
            original = proposer.propose

            def timed(inp, original=original, timings=timings):
                start = time.perf_counter()
                out = original(inp)
                if inp.sample_rows:
                    timings.append(time.perf_counter() - start)
                return out

            proposer.propose = timed
            llm.generate(prompts[-2:], SamplingParams(max_tokens=4), use_tqdm=False)
            for b in sizes:
                timings.clear()
                start = time.perf_counter()
                outs = llm.generate(prompts[:b], params, use_tqdm=False)
                tps = b * args.max_tokens / (time.perf_counter() - start)
                per_step = statistics.median(timings)
                draft_step = per_step / args.k
                drafted = sum(o.spec_metrics["num_drafted"] for o in outs)
                accepted = sum(o.spec_metrics["num_accepted"] for o in outs)
                print(f"{name:8s} {b:3d} {draft_step * 1e3:9.2f} ms {draft_step / decode[b]:8.2f}x "
                      f"{per_step * 1e3:10.1f} ms {tps:7.1f} {tps / plain_tps[b]:8.2f}x {accepted / drafted:8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
