"""What every drafter network shares: the declared needs, the step interface, the target's parts.

A drafter runs inside the forward context exactly like the target: its attention layers are eyas
``Attention`` modules, each with its own ``kv_cache_group`` and ``kv_cache``, so the runner binds
caches and builds per-group metadata for it as for any model.

Drafting one request is a chain of *steps*. The draft prefill runs steps ``0 ..
num_step_layers - 1`` over the committed prefix, each filling one step layer's KV cache; step 0's
last row gives the first draft. Draft decode steps ``j = 1 .. k-1`` are single-token forwards fed
with the previous draft token and the previous step's feedback hidden state. Inputs are shifted
left by one: the token at position ``t + 1`` is paired with the target's hidden state at ``t``.

Worked example (EAGLE-3, one request: prompt x0..x4, the target just emitted x5, k = 3):

    step 0: input_ids [x1 x2 x3 x4 x5], positions [0 1 2 3 4], hidden = target aux states at 0..4
            -> last row: draft d6 (the token at position 6) and feedback f4
    step 1: input_ids [d6], positions [5], hidden = f4 -> d7, f5
    step 2: input_ids [d7], positions [6], hidden = f5 -> d8

A parallel drafter (``parallel_depths = K > 0``, P-EAGLE) replaces the decode steps by ONE forward of
k-1 mask rows per request, after step 0's row: same example, k = 3:

    parallel: input_ids [m m], positions [5 6], hidden = [mask_hidden, mask_hidden] -> d7, d8

where ``m`` is the checkpoint's mask token and ``mask_hidden`` a learned stand-in for the target's aux
states. The row at position 4 + d (depth d) sees the prefix's entries 0..4 and the mask rows before it.

A drafter that does not advance positions (``advances_positions = False``) runs every decode step
at the prefix's last position instead (4 above), overwriting its step layer's entry there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from eyas.model.llama import Attention


@dataclass
class TargetParts:
    """The target's modules a drafter reads without copying them.

    Held in a plain dataclass, so they are not registered as the drafter's submodules: the
    drafter's ``state_dict``, ``parameters()`` and ``.to()`` cover its own weights only.
    """

    embed_tokens: nn.Embedding  # [V, Ht]
    lm_head: nn.Module  # Ht -> V


class Drafter(nn.Module, ABC):
    """Base class; subclasses set the declared attributes below (from their class or config).

    ``forward(step, input_ids [T], positions [T], hidden [T, H_in])`` returns
    ``(logits_hidden [T, H], feedback_hidden [T, H])``: what ``compute_logits(step, ...)`` reads,
    and what the next step takes as ``hidden``. Both may depend on ``step`` only through
    ``step == 0`` and ``step % num_step_layers`` (one CUDA graph serves every such class), and may
    not read device values on the host. ``compute_logits`` returns float32 logits over the
    TARGET vocabulary ``[T, V]``.
    """

    method: ClassVar[str]  # "eagle", "eagle3", "mtp"
    target_hidden: ClassVar[str]  # step 0's hidden: "aux" (concatenated aux states) or "last" (the target's
    # last hidden state after its final norm, ``ModelOutput.hidden``)
    # every tensor of its checkpoint files is its own (False: MTP layers sit among the target's tensors)
    owns_checkpoint_files: ClassVar[bool] = True

    def __init__(self, target: TargetParts, vocab_size: int, shares_target_head: bool):
        super().__init__()
        self.target = target
        self.vocab_size = vocab_size  # the target's
        self.shares_target_head = shares_target_head  # logits from the target's lm_head (else an own head)
        self.aux_layer_ids: tuple[int, ...] = ()  # vLLM convention, ascending: the order of the aux states
        self.advances_positions = True  # decode step j runs at position P + j (else at P, the prefix's last)
        self.num_step_layers = 1  # draft step j uses step layer j % num_step_layers
        # drafts 2..K come from one forward of mask rows after draft 1's row (P-EAGLE); 0: a chain drafter
        self.parallel_depths = 0
        self.embed_tokens: nn.Embedding | None = None  # own embedding; None = the target's
        self.spec = None  # eyas.model.drafters.checkpoint.DrafterSpec, set by load_drafter

    @property
    def shares_target_embedding(self) -> bool:
        return self.embed_tokens is None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.target.embed_tokens if self.embed_tokens is None else self.embed_tokens
        return table(input_ids)

    @abstractmethod
    def attention_layers(self) -> list[Attention]:
        """The drafter's attention layers, for the runner to assign KV-cache groups and bind caches."""

    @abstractmethod
    def forward(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    @abstractmethod
    def compute_logits(self, step: int, hidden: torch.Tensor) -> torch.Tensor:
        ...
