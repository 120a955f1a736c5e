"""Writes one safetensors file per request on background threads, atomically.

The engine hands over host tensors and moves on; writer threads serialise them. The queue is
bounded, so when the disk is slower than extraction, ``submit`` blocks (back-pressure) instead of
piling tensors up in memory. Each file is written under a temporary name in the same folder and
then renamed, so a reader, or a job resumed after ``kill -9``, never sees a truncated file. A
worker's error is raised by the next ``submit`` or ``flush``: nothing is dropped silently.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

TMP_SUFFIX = ".tmp"


class HiddenStatesWriter:
    def __init__(self, output_dir: str | os.PathLike, metadata: dict[str, str] | None = None,
                 num_threads: int = 2, max_pending: int = 8):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metadata = dict(metadata or {})
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._work, name=f"eyas-writer-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def path_for(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"request_id: '{name}' cannot name a file (no path separators or leading dot)")
        return self.output_dir / f"{name}.safetensors"

    def submit(self, name: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Queue ``tensors`` (host, contiguous) for ``{output_dir}/{name}.safetensors``; returns that path."""
        self._raise_error()
        path = self.path_for(name)
        self._queue.put((path, tensors))  # blocks while max_pending files wait
        return path

    def flush(self) -> None:
        """Block until every queued file is on disk; raise the first worker error."""
        self._queue.join()
        self._raise_error()

    def close(self) -> None:
        self._queue.join()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"hidden-state writer failed ({self.output_dir}): {self._error}") from self._error

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                path, tensors = item
                tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
                save_file(tensors, str(tmp), metadata=self.metadata)
                os.replace(tmp, path)
            except BaseException as error:  # surfaced to the engine thread by submit/flush
                if self._error is None:
                    self._error = error
            finally:
                self._queue.task_done()
