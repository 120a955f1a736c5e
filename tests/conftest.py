import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}
