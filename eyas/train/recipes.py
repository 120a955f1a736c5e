"""The drafters eyas trains, built from the engine's own drafter networks, and their unrolled forward.

A recipe builds a fresh drafter next to the frozen target (embedding, and MTP's head, shared in
place), names the training vocabulary, and says what step 0's hidden input is. ``unroll`` runs
training-time test through the drafter's own ``forward(step, ...)``: the same code that drafts in
the engine, with :class:`eyas.train.attention.TrainingAttention` in place of the paged backend.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from eyas.model.drafters import Eagle3Drafter, MtpDrafter, TargetParts
from eyas.model.drafters.base import Drafter
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.train.attention import LayerKeys, TrainingAttention
from eyas.train.data import Batch
from eyas.train.vocab import select_draft_vocabulary


def _init_(module: nn.Module, std: float = 0.02) -> None:
    """HF-style initialisation: matrices ~ N(0, std), norms 1, biases 0 (seeded by the caller)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()


class Recipe(ABC):
    method: ClassVar[str]
    uses_aux: ClassVar[bool]  # step 0 reads the aux streams (else the target's normed last state)
    vllm_loads: ClassVar[bool]  # vLLM serves the exported folder as it is (its model card says how)
    trains_parallel: ClassVar[bool] = False  # can train parallel drafting depths (--parallel-drafting)

    def __init__(self, target: nn.Module, max_positions: int):
        self.target = target
        self.max_positions = max_positions
        self.drafter: Drafter

    @classmethod
    @abstractmethod
    def for_run(cls, target: nn.Module, max_positions: int, config, data) -> "Recipe":
        """The recipe an ``eyas train`` run asks for: ``config`` its TrainConfig, ``data`` its validated
        training data (aux layer ids, token frequencies)."""

    @property
    @abstractmethod
    def vocab_ids(self) -> torch.Tensor | None:
        """[Vd] ascending target ids the drafter predicts over (None: the whole vocabulary)."""

    @abstractmethod
    def first_hidden(self, batch: Batch) -> torch.Tensor:
        """Step 0's hidden input, flat ``[B*T, H_in]``."""

    @abstractmethod
    def logits(self, step: int, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, Vd] logits over the training vocabulary."""

    def prefill_steps(self) -> list[int]:
        """Steps run over the target's states before the unroll, only to record step layers' base keys."""
        return []

    def load_weights(self, loaded: Drafter, folder: str) -> None:
        """Start from ``loaded`` (``--init``): a drafter of the same shape, read from ``folder``; a parallel run
        from a chain drafter keeps its fresh ``mask_hidden`` (depth 0 starts as the chain drafter)."""
        mine, theirs = self.drafter.state_dict(), loaded.state_dict()
        if self.drafter.parallel_depths and not loaded.parallel_depths:
            theirs["mask_hidden"] = mine["mask_hidden"]
        wrong = sorted(k for k in mine if k not in theirs or theirs[k].shape != mine[k].shape)
        if wrong:
            raise ValueError(f"init: the drafter in '{folder}' does not have this run's shape ({', '.join(wrong[:4])} "
                             "differ); give --num-layers as the folder has it")
        self.drafter.load_state_dict({k: theirs[k].to(v.dtype) for k, v in mine.items()})


class Eagle3Recipe(Recipe):
    """EAGLE-3: fc over the aux streams, ``num_layers`` decoder layers (the first over embedding and hidden
    state), own head over the draft vocabulary (initialised from the target's rows, and its final norm from
    the target's); the embedding is the target's, frozen."""

    method = "eagle3"
    uses_aux = True
    vllm_loads = True  # the SafeAILab / SpecForge layout
    trains_parallel = True

    MASK_TOKEN_ID = 0  # fed at depths >= 1 of a parallel drafter; its embedding is the target's, frozen

    def __init__(self, target: nn.Module, max_positions: int, *, aux_layer_ids: tuple[int, ...],
                 vocab_ids: torch.Tensor, num_layers: int = 1, parallel_depths: int = 0):
        super().__init__(target, max_positions)
        cfg = target.config
        layer = dataclasses.replace(cfg, num_layers=num_layers, qk_norm=False, attention_bias=False,
                                    architecture="LlamaForCausalLM", tie_word_embeddings=False)
        self.drafter = Eagle3Drafter(layer, TargetParts(target.embed_tokens, target.lm_head),
                                     target_hidden_size=cfg.hidden_size, draft_vocab_size=len(vocab_ids),
                                     aux_layer_ids=aux_layer_ids, max_positions=max_positions, own_embedding=False,
                                     parallel_depths=parallel_depths, mask_token_id=self.MASK_TOKEN_ID)
        _init_(self.drafter)
        with torch.no_grad():
            self.drafter.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
            self.drafter.norm.weight.copy_(target.norm.weight)
        self.drafter.set_draft_vocabulary(vocab_ids)

    @classmethod
    def for_run(cls, target: nn.Module, max_positions: int, config, data) -> "Eagle3Recipe":
        loaded = _load_init(config, target, max_positions, cls.method)
        if loaded is None:
            vocab = select_draft_vocabulary(data.frequencies, config.draft_vocab_size, target.config.vocab_size)
        else:  # fine-tuning keeps the folder's draft vocabulary and reads the streams it was trained on
            vocab = loaded.d2t + torch.arange(loaded.draft_vocab_size)
            if loaded.aux_layer_ids != data.aux_layer_ids:
                raise ValueError(f"init: the drafter in '{config.init}' reads layers {list(loaded.aux_layer_ids)}, "
                                 f"the data gives {list(data.aux_layer_ids)}; pass --aux-layer-ids "
                                 f"{','.join(map(str, loaded.aux_layer_ids))}")
        recipe = cls(target, max_positions, aux_layer_ids=data.aux_layer_ids,
                     vocab_ids=vocab.to(target.embed_tokens.weight.device), num_layers=config.num_layers,
                     parallel_depths=config.parallel_depths)
        if loaded is not None:
            recipe.load_weights(loaded, config.init)
        return recipe

    @property
    def vocab_ids(self) -> torch.Tensor:
        return self.drafter.d2t + torch.arange(self.drafter.draft_vocab_size, device=self.drafter.d2t.device)

    def first_hidden(self, batch: Batch) -> torch.Tensor:
        return batch.aux.flatten(0, 1)  # [B*T, n_aux * Ht]

    def logits(self, step: int, normed: torch.Tensor) -> torch.Tensor:
        return self.drafter.lm_head(normed)


class MtpRecipe(Recipe):
    """MTP layers (DeepSeek layout) for a target that has none: each block starts as a copy of the target's
    last decoder layer, ``eh_proj`` at random; embedding and head are the target's, frozen and shared."""

    method = "mtp"
    uses_aux = False
    vllm_loads = False  # vLLM reads MTP layers only for architectures that define them

    def __init__(self, target: nn.Module, max_positions: int, *, num_layers: int):
        super().__init__(target, max_positions)
        cfg = target.config
        self.drafter = MtpDrafter(cfg, TargetParts(target.embed_tokens, target.lm_head),
                                  sliding_windows=(None,) * num_layers, own_heads=False, max_positions=max_positions)
        _init_(self.drafter)
        last = target.layers[-1].state_dict()
        for layer in self.drafter.layers:
            layer.load_state_dict(last, strict=False)
            with torch.no_grad():
                layer.shared_head.norm.weight.copy_(target.norm.weight)

    @classmethod
    def for_run(cls, target: nn.Module, max_positions: int, config, data) -> "MtpRecipe":
        recipe = cls(target, max_positions, num_layers=config.num_layers)
        loaded = _load_init(config, target, max_positions, cls.method)
        if loaded is not None:
            recipe.load_weights(loaded, config.init)
        return recipe

    @property
    def vocab_ids(self) -> None:
        return None

    def first_hidden(self, batch: Batch) -> torch.Tensor:
        return self.target.norm(batch.last.flatten(0, 1))  # [B*T, Ht], what ModelOutput.hidden holds

    def logits(self, step: int, normed: torch.Tensor) -> torch.Tensor:
        return self.drafter.compute_logits(step, normed)

    def prefill_steps(self) -> list[int]:
        return list(range(1, self.drafter.num_step_layers))


def _load_init(config, target: nn.Module, max_positions: int, method: str) -> Drafter | None:
    """The drafter of ``config.init`` (a folder eyas loads, of this method), or None without ``--init``."""
    if config.init is None:
        return None
    from eyas.model.drafters.checkpoint import load_drafter

    try:
        return load_drafter(config.init, target, dtype=torch.float32, device=torch.device("cpu"),
                            max_positions=max_positions, method=method)
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"init: '{config.init}' is not a {method} drafter folder eyas loads ({error})") from None


def unroll(recipe: Recipe, batch: Batch, num_steps: int) -> list[torch.Tensor]:
    """Training-time test: ``num_steps`` drafter steps over the padded batch; the normed output ``[B, T, H]``
    of each step (``recipe.logits`` turns rows of it into logits).

    Step i at index t is fed token ``x_{t+1+i}`` at position ``t + i`` (``t`` for a drafter whose
    positions stay put) and, for i > 0, the drafter's own step ``i - 1`` output at t.
    """
    drafter = recipe.drafter
    bsz, seq = batch.token_ids.shape
    layers = drafter.attention_layers()
    keys = {}
    for group, layer in enumerate(layers):
        layer.kv_cache_group = group
        keys[group] = LayerKeys(bsz, seq, advances_positions=drafter.advances_positions)
    shifted = torch.nn.functional.pad(batch.token_ids, (0, num_steps))  # [B, T + S], zeros past the end
    base = torch.arange(seq, device=batch.token_ids.device).expand(bsz, seq)
    hidden0 = recipe.first_hidden(batch)
    out = []
    with forward_context(ForwardContext(TrainingAttention(), keys)):
        inputs0 = shifted[:, 1:seq + 1].reshape(-1)
        for step in recipe.prefill_steps():
            drafter(step, inputs0, base.reshape(-1), hidden0)
        hidden = hidden0
        for step in range(num_steps):
            input_ids = shifted[:, 1 + step:seq + 1 + step].reshape(-1)  # [B*T]
            positions = (base + (step if drafter.advances_positions else 0)).reshape(-1)
            normed, hidden = drafter(step, input_ids, positions, hidden)
            out.append(normed.view(bsz, seq, -1))
    return out


RECIPES: dict[str, type[Recipe]] = {"eagle3": Eagle3Recipe, "mtp": MtpRecipe}
