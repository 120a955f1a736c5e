"""The training loop: AdamW with warmup and decay, gradient clipping, atomic resumable checkpoints,
progress, ``metrics.jsonl``, data-parallel training under ``torchrun`` (DDP: gloo on CPU, NCCL on
CUDA), and the export at the end.

Resuming: a checkpoint (``checkpoint.pt``) holds the drafter's weights, the optimizer's state, the
step count (the schedule is a function of it), the RNG states and the data position (epoch,
batch). The batch plan of an epoch is a function of the seed and the epoch, so a resumed run
trains on exactly the batches the uninterrupted run would have, in the same order, and on the
CPU (deterministic kernels, same thread count) ends with bitwise the same weights.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eyas.config import EngineConfig, ModelConfig
from eyas.data.manifest import changed_settings, write_json_atomic
from eyas.model.loader import load_model
from eyas.model.resolve import resolve_model
from eyas.train.data import DumpData, plan_batches
from eyas.train.objective import LOSSES, StepStats, TargetHead, native_bf16, step_stats
from eyas.train.parallel import depth_stats
from eyas.train.recipes import RECIPES, Recipe, unroll

logger = logging.getLogger("eyas")
# oneDNN (bf16 matmuls on the CPU) caches a primitive per matmul shape, 1,024 by default; a training
# step's shapes follow its batch, so nearly every step adds new ones: about 10 MB of resident memory per
# step (11 GB, and the OOM killer, after 170 steps of a 4,096-token EAGLE-3 run). A step uses a few dozen
# shapes; 64 keeps them and bounds the cache. Read when oneDNN makes its first primitive.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
SCHEDULES = ("cosine", "linear", "constant")
CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of ``eyas train`` (``--help`` explains each); validated at construction."""

    method: str
    data: tuple[str, ...]  # dump folders, or with --online conversation sources (a str is one)
    out: str
    model: str | None = None
    online: bool = False
    max_samples: int | None = None  # --online: conversations to read from each source
    loss_masks: str | None = None  # plain dump folders
    layers: tuple[int, ...] | None = None  # plain dump folders: the layer id of each slot
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3: streams to fuse (default: the dumps' or (2, N//2, N-3))
    # the recipe measured best on a 2-core CPU (the shipped drafter's): a 8,192-token draft vocabulary and 4 unroll
    # steps trained at about 836 tokens/s there, SpecForge's GPU-sized 32,000 and 7 at 229
    draft_vocab_size: int = 8192
    num_layers: int = 1  # EAGLE-3: decoder layers; MTP: MTP layers
    unroll_steps: int = 4
    parallel_depths: int = 0  # EAGLE-3: K > 0 trains a parallel (P-EAGLE) drafter of K depths (eyas.train.parallel)
    depth_keep: float = 0.5  # parallel: depth d trains at a fraction keep ** d of the positions ...
    depth_floor: float = 0.05  # ... and at least this fraction
    step_decay: float = 0.8
    loss: str = "soft"
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-4
    schedule: str = "cosine"
    warmup_steps: int | None = None  # None: 2% of the steps
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    max_len: int = 2048
    batch_tokens: int = 8192
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    autocast: str = "auto"  # "auto": bf16 on CUDA and on CPUs with native bf16 matmuls; "on"; "off"
    device: str | None = None
    resume: bool = False
    init: str | None = None  # a drafter folder to start from (fine-tuning) instead of a fresh initialisation

    def __post_init__(self):
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        if isinstance(self.data, (str, os.PathLike)):
            object.__setattr__(self, "data", (str(self.data),))
        object.__setattr__(self, "data", tuple(str(d) for d in self.data))
        need(len(self.data) >= 1, "data: give at least one dump folder (or, with --online, conversation source)")
        need(self.method in RECIPES, f"method: '{self.method}' is not one of {', '.join(RECIPES)}")
        need(self.draft_vocab_size >= 1, f"draft_vocab_size: {self.draft_vocab_size} must be >= 1")
        need(1 <= self.num_layers <= 8, f"num_layers: {self.num_layers} must be in [1, 8]")
        need(1 <= self.unroll_steps <= 16, f"unroll_steps: {self.unroll_steps} must be in [1, 16]")
        need(self.parallel_depths == 0 or 2 <= self.parallel_depths <= 16,
             f"parallel_depths: {self.parallel_depths} must be 0 (a chain drafter) or in [2, 16]")
        parallel = [m for m, recipe in RECIPES.items() if recipe.trains_parallel]
        need(self.parallel_depths == 0 or self.method in parallel,
             f"parallel_depths: parallel drafting trains {', '.join(parallel)} drafters, not {self.method}")
        need(0 < self.depth_keep <= 1, f"depth_keep: {self.depth_keep} must be in (0, 1]")
        need(0 < self.depth_floor <= 1, f"depth_floor: {self.depth_floor} must be in (0, 1]")
        need(0 < self.step_decay <= 1, f"step_decay: {self.step_decay} must be in (0, 1]")
        need(self.loss in LOSSES, f"loss: '{self.loss}' is not one of {', '.join(LOSSES)}")
        need(self.epochs > 0, f"epochs: {self.epochs} must be > 0")
        need(self.max_steps is None or self.max_steps >= 1, f"max_steps: {self.max_steps} must be >= 1")
        need(0 < self.lr < 1, f"lr: {self.lr} must be in (0, 1)")
        need(self.schedule in SCHEDULES, f"schedule: '{self.schedule}' is not one of {', '.join(SCHEDULES)}")
        need(self.warmup_steps is None or self.warmup_steps >= 0, f"warmup_steps: {self.warmup_steps} must be >= 0")
        need(self.grad_clip > 0, f"grad_clip: {self.grad_clip} must be > 0")
        need(self.max_len >= 8, f"max_len: {self.max_len} must be >= 8")
        need(self.batch_tokens >= self.max_len, f"batch_tokens: {self.batch_tokens} must be >= max_len {self.max_len}")
        need(self.checkpoint_every >= 1, f"checkpoint_every: {self.checkpoint_every} must be >= 1")
        need(self.autocast in ("auto", "on", "off"), f"autocast: '{self.autocast}' is not one of auto, on, off")
        need(not (self.online and (self.loss_masks or self.layers)),
             "online: --loss-masks and --layers describe dump folders; --online reads conversations")

    def pinned(self) -> dict:
        """The settings a resumed run must share (everything but where and how long it runs)."""
        skip = {"resume", "device", "log_every", "checkpoint_every", "max_steps", "epochs"}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k not in skip}


def _malloc_trim():
    """glibc's ``malloc_trim``, or None elsewhere. A CPU training step frees gigabytes of tensors whose
    sizes change with the batch; glibc keeps the freed heap, and the resident set grew ~60 MB per step
    (measured, 4,096-token EAGLE-3 batches). Trimming after each step keeps it flat, for well under 1%
    of a step."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DrafterLoss(nn.Module):
    """The unrolled loss as a module (what DDP wraps): sums per step, for the caller to normalise."""

    def __init__(self, recipe: Recipe, config: TrainConfig):
        super().__init__()
        self.recipe = recipe
        self.drafter = recipe.drafter  # registered, so DDP and the optimizer see its parameters
        self.config = config

    def forward(self, batch, targets) -> list[StepStats]:
        config = self.config
        if config.parallel_depths:
            return depth_stats(self.recipe, batch, targets, config.parallel_depths, config.depth_keep,
                               config.depth_floor, config.loss)
        normed = unroll(self.recipe, batch, self.config.unroll_steps)
        return [step_stats(i, out, self.recipe.logits, targets, self.config.loss) for i, out in enumerate(normed)]


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    """Linear warmup to ``lr``, then cosine or linear decay to 0 (or constant) by ``total``."""
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, total // 50)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.schedule == "constant":
        return config.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if config.schedule == "linear":
        return config.lr * (1 - progress)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Trainer:
    def __init__(self, config: TrainConfig, progress: bool = True):
        self.config = config
        self.rank, self.world = _rank()
        self.progress = progress and self.rank == 0
        self.out = Path(config.out)
        self.device = EngineConfig.resolve_device(config.device)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        self.target_config = ModelConfig.from_folder(resolve_model(config.model))
        cfg = self.target_config
        self.max_positions = config.max_len + max(config.unroll_steps, config.parallel_depths) + 1
        self.target = load_model(cfg, torch.float32, self.device, max(self.max_positions, 16))
        self.target.requires_grad_(False)
        recipe = RECIPES[config.method]
        self.data = self._open_data(config.aux_layer_ids if recipe.uses_aux else ())  # validated first
        torch.manual_seed(config.seed)
        self.recipe = recipe.for_run(self.target, self.max_positions, config, self.data)
        self.recipe.drafter.to(self.device).train()
        self.target_head = TargetHead(self.target.norm, self.target.lm_head.weight, self.recipe.vocab_ids)
        self.loss_module = DrafterLoss(self.recipe, config)
        self.model = self.loss_module
        if self.world > 1:
            self.model = nn.parallel.DistributedDataParallel(
                self.loss_module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        params = [p for p in self.recipe.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
        self.autocast = config.autocast == "on" or (config.autocast == "auto" and native_bf16(self.device))
        lengths = self.data.lengths(config.max_len)
        self.lengths = lengths
        per_epoch = len(plan_batches(lengths, config.batch_tokens, config.seed, 0, self.world))
        total = math.ceil(per_epoch * config.epochs)
        self.total_steps = min(total, config.max_steps) if config.max_steps else total
        self.schedule_steps = total  # the schedule spans the planned epochs; --max-steps only stops early
        self.step = 0
        self.position = (0, 0)  # (epoch, batch index) of the next batch
        self.tokens_seen = 0
        self.release_memory = _malloc_trim() if self.device.type == "cpu" else None

    def _open_data(self, aux: tuple[int, ...] | None):
        cfg, config = self.target_config, self.config
        if config.online:
            from eyas.model.tokenizer import Tokenizer
            from eyas.train.online import OnlineData

            ids = aux if aux is not None else (2, cfg.num_layers // 2, cfg.num_layers - 3)
            return OnlineData(config.data, Tokenizer.from_folder(cfg.path), self.target, ids,
                              max_len=config.max_len, max_samples=config.max_samples)
        return DumpData(config.data, cfg, aux, loss_masks=config.loss_masks, layers=config.layers)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _pin(self) -> None:
        """Refuse to mix runs: an existing run folder must hold the same settings."""
        pin = self.out / "train.json"
        changed = changed_settings(pin, self.config.pinned())
        if changed:
            raise ValueError(f"out: {self.out} holds a run with other settings ({', '.join(changed)} differ); "
                             "use the same command to resume it, or a new folder")
        if changed is None and self.config.resume:
            raise ValueError(f"resume: {self.out} holds no run to resume (no train.json)")
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(pin, self.config.pinned())

    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        state = {"drafter": self.recipe.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "position": self.position, "tokens_seen": self.tokens_seen,
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        _save_atomic(state, self.out / CHECKPOINT)

    def load_checkpoint(self) -> bool:
        path = self.out / CHECKPOINT
        if not path.is_file():
            if self.config.resume:
                raise ValueError(f"resume: no {CHECKPOINT} in {self.out}")
            return False
        # on the CPU: the RNG state must stay a CPU ByteTensor (a CUDA run failed to resume); the optimizer and the
        # drafter copy their tensors to their own device
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.recipe.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.position, self.tokens_seen = state["step"], tuple(state["position"]), state["tokens_seen"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        metrics = self.out / "metrics.jsonl"
        if self.rank == 0 and metrics.is_file():  # rows a killed run wrote after its last checkpoint go
            rows = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= self.step]
            metrics.write_text("".join(line + "\n" for line in rows))
        logger.info("train: resuming %s at step %d (epoch %d, batch %d)", self.out, self.step, *self.position)
        return True

    # -- the loop --------------------------------------------------------------------------------------
    def _batches(self):
        """(position after this batch, this rank's sample indices), from the saved position on."""
        epoch, index = self.position
        while True:
            plan = plan_batches(self.lengths, self.config.batch_tokens, self.config.seed, epoch, self.world)
            for i in range(index, len(plan)):
                following = (epoch, i + 1) if i + 1 < len(plan) else (epoch + 1, 0)
                yield following, plan[i][self.rank::self.world]
            epoch, index = epoch + 1, 0

    def train_step(self, indices: list[int]) -> dict:
        config = self.config
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):  # --online: the target's
            batch = self.data.batch(indices, config.max_len, torch.float32)  # forward (2x faster on an AMX CPU)
        batch = type(batch)(*(None if t is None else t.to(self.device) for t in
                              (batch.token_ids, batch.loss_mask, batch.aux, batch.last)))
        targets = self.target_head.distribution(batch.last, batch.token_ids, batch.loss_mask)
        lr = learning_rate(config, self.step, self.schedule_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            stats = self.model(batch, targets)
        counts = torch.stack([s.count for s in stats]).float()
        agree = torch.stack([s.agree.detach() for s in stats]).float()
        loss_sums = torch.stack([s.loss_sum.detach() for s in stats]).float()
        if self.world > 1:
            for t in (counts, agree, loss_sums):
                dist.all_reduce(t)
        weights = [config.step_decay ** i for i in range(len(stats))]
        loss = sum(w * s.loss_sum / counts[i].clamp(min=1) for i, (w, s) in enumerate(zip(weights, stats)))
        self.optimizer.zero_grad(set_to_none=True)
        (loss * self.world).backward()  # DDP averages the ranks' gradients; the sums were normalised globally
        grad_norm = torch.nn.utils.clip_grad_norm_(self.recipe.drafter.parameters(), config.grad_clip)
        self.optimizer.step()
        step_loss = loss_sums / counts.clamp(min=1)
        return {"loss": sum(w * float(x) for w, x in zip(weights, step_loss)), "lr": lr,
                "grad_norm": float(grad_norm), "step_loss": [round(float(x), 4) for x in step_loss],
                "agreement": [round(float(a / max(c, 1)), 4) for a, c in zip(agree, counts)],
                "tokens": int(batch.num_tokens) * self.world}

    def train(self) -> Path:
        self._pin()
        self.load_checkpoint()
        metrics_file = self.out / "metrics.jsonl"
        if self.rank == 0 and self.step == 0:
            metrics_file.unlink(missing_ok=True)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.config.method}", unit="step",
                       dynamic_ncols=True)
        start, start_tokens = time.perf_counter(), self.tokens_seen
        batches = self._batches()
        while self.step < self.total_steps:
            epoch = self.position[0]
            self.position, indices = next(batches)
            row = self.train_step(indices)
            if self.release_memory is not None:
                self.release_memory(0)
            self.step += 1
            self.tokens_seen += row["tokens"]
            rate = (self.tokens_seen - start_tokens) / max(1e-9, time.perf_counter() - start)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {row['loss']:.3f} agree {' '.join(f'{a:.2f}' for a in row['agreement'][:4])} "
                                    f"{rate:.0f} tok/s")
            if self.rank == 0 and (self.step % self.config.log_every == 0 or self.step == self.total_steps):
                with open(metrics_file, "a") as f:
                    f.write(json.dumps({"step": self.step, "epoch": epoch, **row, "tokens_per_s": round(rate, 1),
                                        "tokens_seen": self.tokens_seen}) + "\n")
            if self.step % self.config.checkpoint_every == 0 or self.step == self.total_steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if self.world > 1:  # leave DDP while every rank is alive: its reducer holds the process group, and a gloo
            self.model = self.loss_module  # group torn down at interpreter exit can abort the process (CI saw
            gc.collect()  # "terminate called without an active exception" on one rank of two)
            dist.barrier()
        self.train_seconds = time.perf_counter() - start
        self.tokens_per_second = (self.tokens_seen - start_tokens) / max(1e-9, self.train_seconds)
        if self.tokens_seen == start_tokens and metrics_file.is_file():  # a finished run, re-run for its export:
            rows = metrics_file.read_text().splitlines()  # its card keeps the rate it trained at
            self.tokens_per_second = json.loads(rows[-1])["tokens_per_s"] if rows else 0.0
        return self.out
