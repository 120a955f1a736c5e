"""The bookkeeping of a hidden-state dataset: an append-only journal and the final manifest.

``samples.jsonl`` (the journal) gets one line per sample once its file is on disk (or once it is
known to be unusable). A job killed at any point leaves, at worst, a half-written last line,
which the next run cuts off; a sample whose file exists without a journal line is simply redone
(its file is replaced atomically), so no sample is ever lost or listed twice.

``manifest.json`` is rebuilt from the journal at the end of every run and written atomically.
Loss masks are stored as run lengths that alternate between 0s and 1s, starting with 0s::

    mask [0, 0, 0, 1, 1, 0, 1] -> runs [3, 2, 1, 1]
    mask [1, 1, 0]             -> runs [0, 2, 1]
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from safetensors import safe_open

LOSS_MASK_ENCODING = "run lengths alternating 0s and 1s, starting with a (possibly empty) run of 0s"


def mask_to_runs(mask: list[int]) -> list[int]:
    runs, value, count = [], 0, 0
    for m in mask:
        if m != value:
            runs.append(count)
            value, count = m, 0
        count += 1
    runs.append(count)
    return runs


def runs_to_mask(runs: list[int]) -> list[int]:
    mask: list[int] = []
    for i, run in enumerate(runs):
        mask += [i % 2] * run
    return mask


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def pin_settings(path: Path, settings: dict, refusal: str) -> None:
    """A job's settings: written the first time, and a job resumed with other settings is refused
    (``refusal`` formats ``{changed}``, the keys that differ)."""
    changed = changed_settings(path, settings)
    if changed:
        raise ValueError(refusal.format(changed=", ".join(changed)))
    if changed is None:
        write_json_atomic(path, settings)


def changed_settings(path: Path, settings: dict) -> list[str] | None:
    """Keys whose value differs from the settings pinned in ``path`` (a JSON file); None if nothing is pinned."""
    if not path.is_file():
        return None
    before = json.loads(path.read_text())
    return sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))


class Journal:
    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, dict]:
        """Entries by sample id; a torn last line (a kill mid-append) is cut off the file."""
        if not self.path.is_file():
            return {}
        entries: dict[str, dict] = {}
        good = 0
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break
                entries[entry["id"]] = entry
                good += len(line)
        if good != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return entries

    def append(self, entries: list[dict]) -> None:
        if not entries:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(e) + "\n" for e in entries))
            f.flush()
            os.fsync(f.fileno())


def build_manifest(out_dir: Path, header: dict, entries: dict[str, dict]) -> dict:
    """Manifest of every journaled sample, with token frequencies over loss-masked tokens."""
    samples = [e for _, e in sorted(entries.items()) if "file" in e]
    skipped = [e for _, e in sorted(entries.items()) if "file" not in e]
    frequencies: Counter[int] = Counter()
    for entry in samples:
        with safe_open(str(out_dir / entry["file"]), framework="pt") as f:
            token_ids = f.get_tensor("token_ids").tolist()
        mask = runs_to_mask(entry["loss_mask_runs"])
        frequencies.update(t for t, m in zip(token_ids, mask) if m)
    return {
        **header,
        "loss_mask_encoding": LOSS_MASK_ENCODING,
        "num_samples": len(samples),
        "num_skipped": len(skipped),
        "num_tokens": sum(e["num_tokens"] for e in samples),
        "num_loss_tokens": sum(e["num_loss_tokens"] for e in samples),
        "samples": samples,
        "skipped": skipped,
        "token_frequencies": {str(t): c for t, c in sorted(frequencies.items())},
    }
