"""The ``extract_hidden_states`` method: dump the target's aux hidden states of every request.

It drafts nothing. What makes it a proposer is where it runs: right after each target forward,
with that forward's layout, block tables and aux hidden states (the model computes them in the
same forward, no second pass). Per step:

1. ``propose`` writes the stacked aux states ``[num_tokens, num_layers, hidden]`` of every token
   of the layout (prompt chunks and decode tokens) into a cache-only layer in its own KV-cache
   group, at the slots the group's block tables give those positions. The group follows the
   target's block tables in lockstep: chunked prefill fills it chunk by chunk, preemption
   recomputes it, and prefix-cache hits bring back the blocks of the shared prefix whose states
   were written when that prefix was computed (states depend on the prefix tokens only).
2. It returns no drafts, so the next step is a plain decode (a k = 0 verification). vLLM returns
   the sampled token as a draft because its scheduler always schedules k slots; eyas needs no
   stand-in. ``num_speculative_tokens`` must still be 1, as in vLLM's configuration.
3. The connector, ``request_done``: when a request ends normally (not aborted), its blocks
   still hold its states; their rows are gathered to host memory and handed to writer threads
   that write ``{output_dir}/{request_id}.safetensors`` with ``hidden_states [num_tokens,
   num_layers, hidden]`` (model dtype, layers in the configured order) and ``token_ids
   [num_tokens]`` int64: the prompt, or with ``include_output_tokens`` the prompt and the outputs
   except the last token (which was never fed to the model). A request that opts out of
   speculation (``SamplingParams(speculate=False)``) is not dumped.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from eyas.config import EngineConfig
from eyas.core.step import DoneRequest
from eyas.data.hidden_states_writer import HiddenStatesWriter
from eyas.kv.manager import KVCacheGroupSpec
from eyas.model.cache_only import CacheOnlyLayer
from eyas.spec_decode.options import MethodOptions, option
from eyas.spec_decode.proposer import Proposer, ProposerInput, ProposerOutput

LAYER_CONVENTION = "vllm"  # aux id k = the residual stream entering decoder layer k


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """'2,15,27' -> (2, 15, 27), for the command line."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids like 2,15,27, got {text!r}") from None


@dataclass(frozen=True)
class ExtractOptions(MethodOptions):
    aux_layer_ids: tuple[int, ...] | None = option(
        None, "extract_hidden_states: layer ids to dump, comma-separated (vLLM convention: id k = the stream "
              "entering layer k)", flag="--spec-aux-layer-ids", parse=parse_layer_ids)
    output_dir: str | None = option(None, "extract_hidden_states: folder for the files", flag="--spec-output-dir",
                                    parse=str)
    include_output_tokens: bool = option(False, "extract_hidden_states: dump generated tokens too",
                                         flag="--spec-include-output")

    def validate(self) -> None:
        ids = self.aux_layer_ids
        if not ids:
            raise ValueError("speculative_config.aux_layer_ids: method 'extract_hidden_states' needs the layer ids "
                             "to dump, e.g. [2, 15, 27] (vLLM convention: id k = the stream entering layer k, "
                             "0 = embeddings, N = after the last layer)")
        if isinstance(ids, str) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"speculative_config.aux_layer_ids: {ids!r} must be a list of layer ids (ints)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"speculative_config.aux_layer_ids: {list(ids)} has repeated ids")
        object.__setattr__(self, "aux_layer_ids", tuple(ids))
        if not self.output_dir:
            raise ValueError("speculative_config.output_dir: method 'extract_hidden_states' needs a folder for "
                             "the {request_id}.safetensors files")


class ExtractHiddenStatesProposer(Proposer):
    method = "extract_hidden_states"
    Options = ExtractOptions

    @classmethod
    def validate_config(cls, config) -> None:
        if config.num_speculative_tokens != 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: method 'extract_hidden_states' needs 1 "
                             f"(it drafts nothing), got {config.num_speculative_tokens}")

    def __init__(self, spec, config: EngineConfig, target):
        options = spec.options
        num_layers = config.model.num_layers
        for layer_id in options.aux_layer_ids:
            if not 0 <= layer_id <= num_layers:
                raise ValueError(f"speculative_config.aux_layer_ids: {layer_id} is outside [0, {num_layers}] for "
                                 f"{config.model.path} (0 = embeddings, {num_layers} = after the last layer)")
        self.aux_layer_ids = options.aux_layer_ids
        self.include_output_tokens = options.include_output_tokens
        self.dtype, self.device = config.dtype, config.device
        self.block_size = config.cache.block_size
        self.layer = CacheOnlyLayer(len(options.aux_layer_ids), config.model.hidden_size, kv_cache_group=-1)
        metadata = {"aux_layer_ids": ",".join(map(str, options.aux_layer_ids)), "layer_convention": LAYER_CONVENTION,
                    "model": str(config.model.path), "dtype": str(config.dtype).removeprefix("torch."),
                    "hidden_size": str(config.model.hidden_size), "num_model_layers": str(num_layers)}
        try:
            self.writer = HiddenStatesWriter(options.output_dir, metadata)
        except OSError as error:
            raise ValueError(f"speculative_config.output_dir: cannot write to '{options.output_dir}' ({error})") from error

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        return [KVCacheGroupSpec("hidden_states", ("hidden_states",), self.layer.bytes_per_token(self.dtype))]

    def bind_kv_caches(self, num_blocks: int, block_size: int, first_group: int) -> None:
        self.layer.kv_cache_group = first_group
        self.layer.bind_cache(num_blocks * block_size, self.dtype, self.device)

    @torch.inference_mode()
    def propose(self, inp: ProposerInput) -> ProposerOutput:
        slots = torch.tensor(inp.slots_in(self.layer.kv_cache_group, self.block_size), dtype=torch.int64,
                             device=self.device)
        self.layer.write(inp.aux_hidden_states, slots)  # [num_tokens, num_layers, hidden]
        num_rows = len(inp.sample_rows)
        return ProposerOutput(torch.zeros(num_rows, 1, dtype=torch.int64, device=self.device),
                              torch.zeros(num_rows, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def request_done(self, done: DoneRequest) -> str | None:
        """Dump a request that finished normally: the states of its prompt (with ``include_output_tokens``, of
        every token but the last, which was never fed to the model)."""
        if done.block_tables is None:
            return None
        num_tokens = len(done.token_ids) - 1 if self.include_output_tokens else done.num_prompt_tokens
        positions = torch.arange(num_tokens)
        table = torch.tensor(done.block_tables[self.layer.kv_cache_group], dtype=torch.int64)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        states = self.layer.gather(slots.to(self.device)).cpu()  # [num_tokens, num_layers, hidden]
        ids = torch.tensor(done.token_ids[:num_tokens], dtype=torch.int64)
        return str(self.writer.submit(done.request_id, {"hidden_states": states, "token_ids": ids}))

    def flush(self) -> None:
        self.writer.flush()
