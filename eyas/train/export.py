"""What a training run leaves in its folder besides the checkpoint: the drafter in a public layout, a
PNG plot of the metrics, and a model card (README.md).

The folder is itself the drafter: ``speculative_config={"method": "eagle3" | "mtp", "model": OUT}``
in eyas, and the SafeAILab / SpecForge EAGLE-3 layout (or speculators', with ``--format
speculators``) for vLLM and SGLang.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from eyas.model.drafters import save_drafter

FORMATS = {"eagle3": ("eagle3", "speculators"), "mtp": ("mtp",)}


def export(trainer, fmt: str | None, *, dtype: torch.dtype = torch.bfloat16, num_speculative_tokens: int | None = None,
           verifier: str | None = None) -> Path:
    drafter = trainer.recipe.drafter
    fmt = fmt or drafter.method
    if fmt not in FORMATS[drafter.method]:
        raise ValueError(f"format: '{fmt}' is not a format of {drafter.method} drafters ({', '.join(FORMATS[drafter.method])})")
    cfg = trainer.target_config
    return save_drafter(drafter, trainer.out, fmt, verifier=verifier or str(cfg.path),
                        verifier_architectures=(cfg.architecture,), num_speculative_tokens=num_speculative_tokens,
                        dtype=dtype)


def read_metrics(out: Path) -> list[dict]:
    file = out / "metrics.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []


def plot(out: Path) -> Path | None:
    """training.png: loss and per-unroll-step top-1 agreement with the target against steps."""
    rows = read_metrics(out)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    pinned = out / "train.json"  # the run's settings
    unit = "depth" if pinned.is_file() and json.loads(pinned.read_text()).get("parallel_depths") else "step"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    # markers: a run that logged one point still shows it (a line needs two)
    left.plot(steps, [r["loss"] for r in rows], marker="o", markersize=3)
    left.set(xlabel="step", ylabel="loss (weighted over unroll steps)", title="loss")
    for i in range(len(rows[0]["agreement"])):
        right.plot(steps, [r["agreement"][i] for r in rows], label=f"{unit} {i}", marker="o", markersize=3)
    right.set(xlabel="step", ylabel="top-1 agreement with the target", title="agreement per unroll step", ylim=(0, 1))
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "training.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def model_card(trainer, argv: list[str], evaluation: dict | None) -> Path:
    """README.md: how it was made (command, data, steps, throughput) and what it measured."""
    config, out = trainer.config, trainer.out
    rows = read_metrics(out)
    last = rows[-1] if rows else {}
    lines = [f"# {config.method} drafter for {trainer.target_config.path.name}", "",
             "Trained with `eyas train` (training-time test, distillation to the target's distribution).", "",
             "## How it was made", "", "```", shlex.join(["eyas", "train", *argv]), "```", "",
             f"- data: `{' '.join(config.data)}` ({'online' if config.online else 'hidden-state dumps'}), "
             f"{len(trainer.lengths)} samples, {sum(trainer.lengths)} tokens (max_len {config.max_len})",
             f"- steps: {trainer.step} ({trainer.tokens_seen} tokens seen), batch of {config.batch_tokens} tokens, "
             + (f"parallel drafting: {config.parallel_depths} depths (depth d at keep {config.depth_keep}**d, floor "
              f"{config.depth_floor} of the positions)" if config.parallel_depths else
              f"{config.unroll_steps} unroll steps") + f", lr {config.lr} ({config.schedule}), seed {config.seed}",
             f"- training throughput: {getattr(trainer, 'tokens_per_second', 0):.0f} tokens/s "
             f"on {trainer.device} ({torch.get_num_threads()} threads), {trainer.world} process(es)",
             f"- final loss {last.get('loss', float('nan')):.4f}; top-1 agreement per unroll step: "
             f"{last.get('agreement')}", ""]
    if evaluation:
        kind = "parallel" if config.parallel_depths else "chain"
        lines += [f"## Measured acceptance (eyas engine, greedy {kind} drafting, batch 1)", "",
                  f"{evaluation['num_prompts']} held-out prompts, {evaluation['max_tokens']} new tokens; "
                  f"plain target {evaluation['plain_tok_s']} tok/s ({evaluation['weights']}).",
                  "",
                  "| k | mean acceptance length | per-position acceptance | tok/s | speedup |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['k']} | {r['mean_acceptance_length']:.2f} | {' '.join(f'{a:.2f}' for a in r['per_position'])} "
                  f"| {r['tok_s']:.1f} | {r['speedup']:.2f}x |" for r in evaluation["rows"]]
        lines += ["", f"Fastest k: {evaluation.get('best_k')} (the default k of this folder).", ""]
    lines += ["## Use", "", "```python", "from eyas import LLM",
              f"llm = LLM({config.model!r}, speculative_config={{\"method\": \"{config.method}\", "
              + ("\"parallel_drafting\": True, " if config.parallel_depths else "")
              + "\"model\": \"path/to/this/folder\"})", "```", "",
              "vLLM: `--speculative-config '{\"method\": \"eagle3\", \"model\": \"path/to/this/folder\", "
              "\"num_speculative_tokens\": K}'` (the SafeAILab / SpecForge layout)." if trainer.recipe.vllm_loads
              else "",
              ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
