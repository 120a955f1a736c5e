"""Drafters that ship inside the eyas package, trained by ``scripts/train_default_drafter.sh``.

``LLM(speculative_config={"method": "eagle3"})`` without ``"model"`` on a target listed here uses
the shipped folder (its model card, ``README.md``, says how it was trained and what it measured).
"""

from __future__ import annotations

from pathlib import Path

from eyas.config import ModelConfig

_HERE = Path(__file__).parent
# (method, parallel drafter?, lower-case fragment of the target folder's name) -> folder under eyas/drafters/;
# the first row of a method is its default when no target is known yet. The default model converts to a folder named
# "SmolLM2-135M-Instruct.Q4_1-..." in the eyas cache; an HF download is named "SmolLM2-135M-Instruct".
# No parallel (P-EAGLE) drafter ships yet: the one trained by scripts/train_parallel_drafter.sh accepted less than
# the chain drafter at every k (docs/parallel_drafting.md); its row would be ("eagle3", True, fragment).
SHIPPED = {("eagle3", False, "smollm2-135m-instruct"): "smollm2-135m-instruct-eagle3"}


def shipped_drafter(method: str, target: ModelConfig | None = None, parallel: bool = False) -> Path | None:
    """The shipped drafter folder of ``method`` (a parallel one with ``parallel``) for ``target`` (None: the
    method's default), or None."""
    for (m, p, fragment), folder in SHIPPED.items():
        if m == method and p == parallel and (target is None or fragment in target.path.name.lower()):
            path = _HERE / folder
            return path if (path / "config.json").is_file() else None
    return None
