import dataclasses
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


K = 3  # the drafters' k in the tests that use them


@pytest.fixture(scope="session")
def drafters(tiny_models, tmp_path_factory):
    """Random drafters for the tiny llama target, saved in their public layouts."""
    from engine_helpers import randomize_

    from eyas.config import ModelConfig
    from eyas.model.drafters import Eagle1Drafter, Eagle3Drafter, MtpDrafter, TargetParts, save_drafter
    from eyas.model.loader import load_model

    root = tmp_path_factory.mktemp("drafters")
    target_path = tiny_models["llama"]
    cfg = ModelConfig.from_folder(target_path)
    target = load_model(cfg, torch.float32, torch.device("cpu"), 1024)
    parts = TargetParts(target.embed_tokens, target.lm_head)
    one_layer = dataclasses.replace(cfg, num_layers=1)
    folders = {}

    eagle3 = Eagle3Drafter(one_layer, parts, target_hidden_size=64, draft_vocab_size=200, aux_layer_ids=(0, 1, 2),
                           max_positions=1024, own_embedding=False)
    randomize_(eagle3, 1)
    eagle3.set_draft_vocabulary(torch.sort(torch.randperm(320, generator=torch.Generator().manual_seed(9))[:200]).values)
    folders["eagle3"] = save_drafter(eagle3, root / "eagle3", "eagle3", verifier=None, num_speculative_tokens=None)
    folders["eagle3_speculators"] = save_drafter(eagle3, root / "speculators", "speculators",
                                                 verifier=str(target_path), num_speculative_tokens=K)
    parallel = Eagle3Drafter(one_layer, parts, target_hidden_size=64, draft_vocab_size=200, aux_layer_ids=(0, 1, 2),
                             max_positions=1024, own_embedding=False, parallel_depths=4, mask_token_id=7)
    randomize_(parallel, 5)
    parallel.set_draft_vocabulary(torch.sort(torch.randperm(320, generator=torch.Generator().manual_seed(9))[:200]).values)
    folders["peagle"] = save_drafter(parallel, root / "peagle", "eagle3")
    folders["peagle_speculators"] = save_drafter(parallel, root / "peagle_speculators", "speculators",
                                                 verifier=str(target_path), num_speculative_tokens=K)
    two = Eagle3Drafter(dataclasses.replace(cfg, num_layers=2), parts, target_hidden_size=64, draft_vocab_size=320,
                        aux_layer_ids=(0, 1, 2), max_positions=1024, own_embedding=False)
    randomize_(two, 4).set_draft_vocabulary(torch.arange(320))
    folders["eagle3_2_layers"] = save_drafter(two, root / "eagle3_2_layers", "eagle3")
    eagle1 = Eagle1Drafter(one_layer, parts, fc_bias=True, max_positions=1024, own_embedding=False)
    folders["eagle"] = save_drafter(randomize_(eagle1, 2), root / "eagle")
    for name, windows in (("mtp_1", (None,)), ("mtp_2_sliding_full", (8, None)), ("mtp_2", (64, None))):
        mtp = randomize_(MtpDrafter(cfg, parts, sliding_windows=windows, own_heads=False, max_positions=1024), 3)
        shutil.copytree(target_path, root / name)  # DeepSeek layout: MTP layers N.. inside the target folder
        folders[name] = save_drafter(mtp, root / name)
    return SimpleNamespace(target=target_path, folders={k: str(v) for k, v in folders.items()})
