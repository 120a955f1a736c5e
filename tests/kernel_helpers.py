"""A machine without a C compiler, for the tests of every kernel's fallback."""

from __future__ import annotations

import contextlib

from eyas import kernels


@contextlib.contextmanager
def without_c_compiler(monkeypatch, tmp_path, *loaders):
    """CC names a missing program and the kernel cache is an empty folder, so nothing builds or loads;
    ``loaders``: the ``functools`` caches of the kernel loaders under test, cleared on entry and on exit
    (``eyas.kernels.load`` always is)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "kernel-cache"))
    caches = (kernels.load, *loaders)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()
