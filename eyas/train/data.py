"""Training data: one or more hidden-state dump folders (``eyas extract`` or plain vLLM / speculators), checked at the
edge, and a seeded batch plan that a resumed run replays exactly.

A dump folder holds one safetensors file per sample, ``hidden_states [T, n, H]`` (slots in the
order of their layer ids) and ``token_ids [T]``. An ``eyas extract`` folder names its layer ids,
loss masks and token frequencies in ``manifest.json``; a plain folder has its layer ids given
(default: the EAGLE-3 three and the final layer N last, as vLLM's extraction appends it) and its
loss masks from a JSONL file (``{"file": "x.safetensors", "loss_mask": [0, 1, ...]}`` per line)
or all ones. The final layer N (before the final norm) must be there: the target distribution
is computed from it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eyas.config import ModelConfig
from eyas.data.manifest import runs_to_mask


@dataclass(frozen=True)
class DumpSample:
    file: Path
    num_tokens: int
    loss_mask: tuple[int, ...] | None  # None = all ones


@dataclass
class Batch:
    """A padded batch of B sequences of up to T tokens (everything past a sequence's length is padding)."""

    token_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool, assistant tokens within the length
    aux: torch.Tensor | None  # [B, T, n_aux * Ht] the aux streams, ascending layer ids
    last: torch.Tensor  # [B, T, Ht] layer N, before the target's final norm

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


def _refuse(message: str) -> None:
    raise ValueError(f"data: {message}")


class DumpData:
    """The samples of one or more dump folders (all with the same layers), validated against the target
    before anything is trained or written."""

    def __init__(self, folders: str | Path | Sequence[str | Path], target: ModelConfig,
                 aux_layer_ids: tuple[int, ...] | None, *, loss_masks: str | Path | None = None,
                 layers: tuple[int, ...] | None = None):
        """aux_layer_ids: the aux streams the drafter reads (EAGLE-3), () for none (MTP), None = every
        slot but layer N. ``layers``/``loss_masks``: for a plain folder (no manifest)."""
        folders = [Path(folders)] if isinstance(folders, (str, Path)) else [Path(f) for f in folders]
        if loss_masks is not None and len(folders) > 1:
            _refuse("--loss-masks names files of one plain folder; give that folder alone")
        n = target.num_layers
        self.samples: list[DumpSample] = []
        self.frequencies: Counter[int] = Counter()
        self.layer_ids: tuple[int, ...] = ()
        for folder in folders:
            samples, layer_ids, frequencies = self._read_folder(folder, target, loss_masks, layers)
            if self.samples and layer_ids != self.layer_ids:
                _refuse(f"the dumps in '{folder}' hold layers {list(layer_ids)}, those in '{folders[0]}' "
                        f"{list(self.layer_ids)}; folders trained together must hold the same layers")
            self.samples += samples
            self.frequencies.update(frequencies)
            self.layer_ids = layer_ids
        self.final_slot = self.layer_ids.index(n)
        if aux_layer_ids is None:
            aux_layer_ids = tuple(sorted(i for i in self.layer_ids if i != n))
        missing = [i for i in aux_layer_ids if i not in self.layer_ids]
        if missing:
            _refuse(f"the drafter reads layers {list(aux_layer_ids)} but the dumps in '{folders[0]}' hold only "
                    f"{list(self.layer_ids)}")
        self.aux_layer_ids = tuple(sorted(aux_layer_ids))
        self.aux_slots = [self.layer_ids.index(i) for i in self.aux_layer_ids]
        self._check_files(target)

    def _read_folder(self, folder: Path, target: ModelConfig, loss_masks, layers):
        n = target.num_layers
        if not folder.is_dir():
            _refuse(f"'{folder}' is not a folder of hidden-state dumps")
        manifest_file = folder / "manifest.json"
        if manifest_file.is_file():
            samples, layer_ids, frequencies = self._read_manifest(folder, manifest_file, target)
        else:
            samples, layer_ids, frequencies = self._read_plain(folder, target, loss_masks, layers)
        if not samples:
            _refuse(f"no samples in '{folder}' (an empty dataset)")
        if n not in layer_ids:
            _refuse(f"the dumps in '{folder}' hold layers {list(layer_ids)} but not {n} (the final layer, "
                    f"before the final norm), which the target distribution is computed from; re-extract with "
                    f"`eyas extract --layers {','.join(map(str, [*layer_ids, n]))} ...`")
        return samples, layer_ids, frequencies

    def _read_manifest(self, folder: Path, file: Path, target: ModelConfig):
        try:
            manifest = json.loads(file.read_text())
            layer_ids = tuple(manifest["aux_layer_ids"])
            model = manifest.get("model", {})
            entries = manifest["samples"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            _refuse(f"{file} is not an eyas extract manifest ({error})")
        if manifest.get("layer_convention", "vllm") != "vllm":
            _refuse(f"{file}: layer_convention '{manifest['layer_convention']}' (eyas reads vLLM's)")
        for key, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                          ("num_layers", target.num_layers)):
            if key in model and model[key] != ours:
                _refuse(f"{file} was extracted from a model with {key} {model[key]}; the target "
                        f"({target.path}) has {ours}")
        samples = [DumpSample(folder / e["file"], e["num_tokens"], tuple(runs_to_mask(e["loss_mask_runs"])))
                   for e in entries]
        frequencies = Counter({int(t): c for t, c in manifest.get("token_frequencies", {}).items()})
        return samples, layer_ids, frequencies

    def _read_plain(self, folder: Path, target: ModelConfig, loss_masks, layers):
        n = target.num_layers
        files = sorted(folder.glob("*.safetensors"))
        masks: dict[str, list[int]] = {}
        if loss_masks is not None:
            for line_no, line in enumerate(Path(loss_masks).read_text().splitlines(), 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                        masks[Path(row["file"]).name] = [int(bool(m)) for m in row["loss_mask"]]
                    except (json.JSONDecodeError, KeyError, TypeError) as error:
                        _refuse(f"{loss_masks} line {line_no}: expected {{\"file\": ..., \"loss_mask\": [...]}} ({error})")
        samples, frequencies = [], Counter()
        num_slots = None
        for file in files:
            token_ids, shape = self._header(file)
            num_slots = shape[1]
            mask = masks.get(file.name)
            if loss_masks is not None and mask is None:
                _refuse(f"{loss_masks} has no loss mask for {file}")
            if mask is not None and len(mask) != len(token_ids):
                _refuse(f"the loss mask of {file} in {loss_masks} has {len(mask)} entries for {len(token_ids)} tokens")
            samples.append(DumpSample(file, len(token_ids), None if mask is None else tuple(mask)))
            frequencies.update(t for t, m in zip(token_ids.tolist(), mask or [1] * len(token_ids)) if m)
        if layers is None and num_slots is not None:
            layers = (2, n // 2, n - 3, n) if num_slots == 4 else (n,) if num_slots == 1 else None
            if layers is None:
                _refuse(f"the dumps in '{folder}' hold {num_slots} layers per token; name their ids with "
                        f"--layers (vLLM convention, the final layer {n} last)")
        return samples, tuple(layers or ()), frequencies

    def _header(self, file: Path) -> tuple[torch.Tensor, tuple[int, ...]]:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    _refuse(f"{file} lacks {sorted({'hidden_states', 'token_ids'} - keys)}")
                return f.get_tensor("token_ids"), tuple(f.get_slice("hidden_states").get_shape())
        except (SafetensorError, OSError) as error:
            _refuse(f"{file} cannot be read as safetensors ({error})")

    def _check_files(self, target: ModelConfig) -> None:
        """Every file: readable, [T, n, H] matching the layer ids and the target, token ids in the vocabulary."""
        for sample in self.samples:
            token_ids, shape = self._header(sample.file)
            expected = (sample.num_tokens, len(self.layer_ids), target.hidden_size)
            if shape != expected:
                what = "hidden size" if shape[-1:] != expected[-1:] else "shape"
                _refuse(f"{sample.file}: hidden_states has shape {list(shape)}, expected {list(expected)} "
                        f"({what} mismatch; target {target.path}, layers {list(self.layer_ids)})")
            if token_ids.numel() and not (0 <= int(token_ids.min()) and int(token_ids.max()) < target.vocab_size):
                _refuse(f"{sample.file}: token id {int(token_ids.max())} is outside the target's vocabulary "
                        f"of {target.vocab_size} (a dump of another model?)")
            if sample.loss_mask is not None and len(sample.loss_mask) != sample.num_tokens:
                _refuse(f"{sample.file}: loss mask of {len(sample.loss_mask)} for {sample.num_tokens} tokens")

    def lengths(self, max_len: int) -> list[int]:
        return [min(s.num_tokens, max_len) for s in self.samples]

    def batch(self, indices: list[int], max_len: int, dtype: torch.dtype) -> Batch:
        rows = []
        for i in indices:
            sample = self.samples[i]
            with safe_open(str(sample.file), framework="pt") as f:
                hidden = f.get_slice("hidden_states")[:max_len]  # [T, n, H]
                token_ids = f.get_tensor("token_ids")[:max_len]
            mask = torch.ones(len(token_ids), dtype=torch.bool) if sample.loss_mask is None else \
                torch.tensor(sample.loss_mask[:max_len], dtype=torch.bool)
            rows.append((token_ids, mask, hidden.to(dtype)))
        seq = max(len(r[0]) for r in rows)
        ids = torch.zeros(len(rows), seq, dtype=torch.int64)
        mask = torch.zeros(len(rows), seq, dtype=torch.bool)
        hidden = torch.zeros(len(rows), seq, *rows[0][2].shape[1:], dtype=dtype)  # [B, T, n, H]
        for b, (t, m, h) in enumerate(rows):
            ids[b, :len(t)], mask[b, :len(t)], hidden[b, :len(t)] = t, m, h
        aux = hidden[:, :, self.aux_slots].flatten(2) if self.aux_slots else None
        return Batch(ids, mask, aux, hidden[:, :, self.final_slot])


def plan_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, min_rows: int = 1) -> list[list[int]]:
    """Sample indices per batch for one epoch: a seeded shuffle, length-sorted within windows of 256
    samples (little padding), cut so that ``rows * longest <= batch_tokens`` (at least ``min_rows`` rows,
    one per data-parallel rank), then the batches shuffled. Same arguments, same plan."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for start in range(0, len(order), 256):
        current: list[int] = []
        longest = 0
        for i in sorted(order[start:start + 256], key=lambda i: lengths[i]):
            if len(current) >= min_rows and max(longest, lengths[i]) * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, lengths[i])
        if len(current) >= min_rows or not batches:
            batches.append(current)
        else:
            batches[-1].extend(current)
    rng.shuffle(batches)
    return batches
