"""``eyas train eagle3|mtp`` and ``python -m eyas.train`` (the same arguments; under ``torchrun`` it trains
data-parallel). Nothing in the engine imports this package."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,15,27, got {text!r}") from None


def add_train_parser(sub) -> None:
    from eyas.train.recipes import RECIPES

    p = sub.add_parser("train", help="train an EAGLE-3 or MTP drafter from hidden-state dumps (or --online)",
                       description="Train a drafter for the target (--model) by distillation to its next-token "
                                   "distribution with training-time test. Re-running the same command resumes "
                                   "from the last checkpoint in --out.")
    p.add_argument("method", choices=sorted(RECIPES), help="drafter to train")
    p.add_argument("--data", required=True, nargs="+",
                   help="dump folder(s) (`eyas extract` output, or plain vLLM/speculators dumps), trained on "
                        "together (e.g. regenerated and original replies); with --online: conversation sources "
                        "('sharegpt', ShareGPT .json or .jsonl files), trained on together the same way")
    p.add_argument("--out", required=True, help="run folder; at the end it is the drafter folder (config.json, "
                                                "model.safetensors, README.md model card, training.png, metrics.jsonl)")
    p.add_argument("--model", default=None, help="the target: HF folder or .gguf (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--online", action="store_true",
                   help="no dumps: compute the target's states inside the training loop from conversations")
    p.add_argument("--max-samples", type=int, default=None,
                   help="--online: read the first N conversations of each source")
    p.add_argument("--loss-masks", default=None,
                   help="plain dump folders: JSONL of {\"file\": ..., \"loss_mask\": [...]} (default: all ones)")
    p.add_argument("--layers", type=_ids, default=None,
                   help="plain dump folders: the layer id of each slot, final layer N last (default for 4 slots: "
                        "2,N//2,N-3,N)")
    p.add_argument("--aux-layer-ids", type=_ids, default=None,
                   help="eagle3: target streams to fuse, vLLM convention (default: every dumped layer but N)")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="eagle3: most frequent loss-masked target tokens the drafter predicts over (its head is the "
                        "largest matrix of a draft step: smaller is cheaper). Default 8192, the shipped drafter's: on "
                        "2 CPU cores it trains about 3.6x as fast as SpecForge's GPU-sized 32000 with 7 unroll steps")
    p.add_argument("--num-layers", type=int, default=1,
                   help="eagle3: decoder layers of the drafter (vLLM runs several too); mtp: MTP layers M "
                        "(draft step j uses layer j %% M)")
    p.add_argument("--unroll-steps", type=int, default=4,
                   help="training-time test: drafter steps unrolled on its own outputs (default 4, the shipped "
                        "drafter's recipe, sized for a CPU; EAGLE/SpecForge use 7 on GPUs)")
    p.add_argument("--parallel-drafting", action="store_true",
                   help="eagle3: train a parallel (P-EAGLE) drafter of --depths depths, which drafts all its tokens "
                        "in one pass (docs/parallel_drafting.md) instead of unrolling training-time test")
    p.add_argument("--depths", type=int, default=6,
                   help="--parallel-drafting: K, the depths (drafts per pass) trained; it serves k <= K")
    p.add_argument("--depth-keep", type=float, default=0.5,
                   help="--parallel-drafting: depth d trains at a random keep**d of the positions (conditional "
                        "drop-token sampling), so memory does not grow as depths x length")
    p.add_argument("--depth-floor", type=float, default=0.05,
                   help="--parallel-drafting: ... and at no fewer than this fraction of them")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of unroll step i: decay ** i")
    p.add_argument("--loss", choices=["soft", "hard"], default="soft",
                   help="soft: cross-entropy to the target's distribution; hard: to the data's next token")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (fractions allowed)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW)")
    p.add_argument("--schedule", choices=["cosine", "linear", "constant"], default="cosine",
                   help="decay after warmup, to 0 at the end of the planned epochs")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default: 2%% of the steps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5, help="gradient norm clip")
    p.add_argument("--max-len", type=int, default=2048, help="cut samples to this many tokens")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="tokens per optimizer step, padding included (all ranks together)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between atomic checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in --out to resume from (the same command resumes anyway when one exists)")
    p.add_argument("--init", default=None,
                   help="start from this drafter folder (fine-tuning), e.g. the shipped one; eagle3 keeps its draft "
                        "vocabulary (--draft-vocab-size is then ignored)")
    p.add_argument("--format", choices=["eagle3", "speculators", "mtp"], default=None,
                   help="drafter layout: eagle3 (SafeAILab/SpecForge, vLLM), speculators, or mtp (DeepSeek)")
    p.add_argument("--autocast", choices=["auto", "on", "off"], default="auto",
                   help="bf16 autocast of the drafter's training and, with --online, of the target's forward: "
                        "auto = on CUDA and on CPUs with native bf16 matmuls")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--eval-prompts", type=int, default=8,
                   help="held-out ShareGPT prompts (conversations 13,000 on) for the engine measurement; 0 = none")
    p.add_argument("--eval-ks", type=_ids, default=(1, 2, 3, 4, 5, 6), help="draft lengths k to measure")
    p.add_argument("--eval-tokens", type=int, default=128, help="new tokens per held-out prompt")
    p.add_argument("--eval-data", default=None, help="ShareGPT .json / .jsonl for the held-out prompts "
                                                     "(default: the shipped file, from conversation 13,000)")
    p.set_defaults(func=cmd_train)


def _config(args):
    from eyas.train.trainer import TrainConfig

    return TrainConfig(method=args.method, data=args.data, out=args.out, model=args.model, online=args.online,
                       max_samples=args.max_samples, loss_masks=args.loss_masks, layers=args.layers,
                       aux_layer_ids=args.aux_layer_ids, draft_vocab_size=args.draft_vocab_size,
                       num_layers=args.num_layers, unroll_steps=args.unroll_steps, step_decay=args.step_decay,
                       parallel_depths=args.depths if args.parallel_drafting else 0, depth_keep=args.depth_keep,
                       depth_floor=args.depth_floor,
                       loss=args.loss, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
                       schedule=args.schedule, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                       grad_clip=args.grad_clip, max_len=args.max_len, batch_tokens=args.batch_tokens,
                       seed=args.seed, checkpoint_every=args.checkpoint_every, autocast=args.autocast,
                       device=args.device, resume=args.resume, init=args.init)


def _eval_prompts(args, tokenizer) -> list[list[int]]:
    from eyas.data.prompts import HELD_OUT_START, chat_prompts

    start = 0 if args.eval_data else HELD_OUT_START
    conversations = chat_prompts(args.eval_prompts, path=args.eval_data, start=start)
    return [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]


def cmd_train(args, argv: list[str] | None = None) -> int:
    from eyas.model.tokenizer import Tokenizer
    from eyas.train import export
    from eyas.train.evaluate import acceptance_by_k
    from eyas.train.trainer import Trainer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo")
    try:
        trainer = Trainer(_config(args))
        out = trainer.train()
        if trainer.rank != 0:
            return 0
        export.export(trainer, args.format)
        export.plot(out)
        evaluation = None
        if args.eval_prompts > 0:
            prompts = _eval_prompts(args, Tokenizer.from_folder(trainer.target_config.path))
            depths = trainer.config.parallel_depths
            ks = [k for k in args.eval_ks if not depths or k <= depths]  # a parallel drafter drafts <= K tokens
            evaluation = acceptance_by_k(args.model, str(out), args.method, prompts, ks, max_tokens=args.eval_tokens,
                                         num_threads=args.threads, parallel=bool(depths))
            best = max(evaluation["rows"], key=lambda r: r["tok_s"])
            evaluation["best_k"] = best["k"]
            export.export(trainer, args.format, num_speculative_tokens=best["k"])
            for r in evaluation["rows"]:
                print(f"k={r['k']}: mean acceptance length {r['mean_acceptance_length']:.2f}, per position "
                      f"{' '.join(f'{a:.2f}' for a in r['per_position'])}, {r['tok_s']:.1f} tok/s "
                      f"({r['speedup']:.2f}x plain {evaluation['plain_tok_s']:.1f})")
        export.model_card(trainer, argv if argv is not None else sys.argv[2:], evaluation)
        print(f"drafter: {out} ({trainer.step} steps, {trainer.tokens_per_second:.0f} tokens/s); model card "
              f"{out / 'README.md'}")
        return 0
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas.train")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["train", *argv])
    try:
        return args.func(args, argv)
    except ValueError as e:
        print(f"eyas train: {e}", file=sys.stderr)
        return 2
