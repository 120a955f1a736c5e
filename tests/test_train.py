"""``eyas train``: the trainers learn (measured by the engine), resume bitwise after ``kill -9``, train
data-parallel like one process, export round trips, and refuse bad input by name.

The tiny target's head is scaled up so its next-token distributions are peaked (a random tiny model
is near-uniform, and argmax ties would decide everything). Training data is the target's own
greedy continuation of random prompts, dumped by the engine's ``extract_hidden_states`` with the
output tokens: a plain vLLM-style dump folder plus a loss-mask file (the replies).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas import LLM, SamplingParams
from eyas.model.drafters import load_drafter, save_drafter
from eyas.train.trainer import TrainConfig, Trainer

LAYERS = [0, 1, 2, 3]  # the tiny target has 3 layers: aux 0, 1, 2 and the final layer 3
NUM_PROMPTS, REPLY = 24, 40


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(6, 16, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny Llama whose head is scaled 8x, and a dump folder of its own greedy replies."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("train")
    model = make_tiny_model(root / "peaked", "llama", seed=3)
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    dumps = root / "dumps"
    prompts = _prompts(NUM_PROMPTS, seed=0)
    llm = LLM(str(model), speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                              "aux_layer_ids": LAYERS, "output_dir": str(dumps),
                                              "include_output_tokens": True})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True), use_tqdm=False)
    llm.engine.flush()
    with open(root / "masks.jsonl", "w") as f:
        for prompt, out in zip(prompts, outs):
            n = len(prompt) + len(out.outputs[0].token_ids) - 1
            f.write(json.dumps({"file": Path(out.hidden_states_path).name,
                                "loss_mask": [0] * len(prompt) + [1] * (n - len(prompt))}) + "\n")
    return {"model": model, "dumps": dumps, "masks": root / "masks.jsonl", "prompts": prompts, "root": root}


def _config(peaked, out, method="eagle3", **over) -> TrainConfig:
    kw = dict(method=method, data=str(peaked["dumps"]), out=str(out), model=str(peaked["model"]),
              loss_masks=str(peaked["masks"]), layers=tuple(LAYERS), draft_vocab_size=320, unroll_steps=3,
              epochs=12, lr=3e-3, batch_tokens=512, max_len=64, checkpoint_every=1000, log_every=1, autocast="off")
    kw.update(over)
    return TrainConfig(**kw)


def _acceptance(peaked, folder: Path, method: str, k: int = 3) -> tuple[float, list]:
    llm = LLM(str(peaked["model"]), speculative_config={"method": method, "model": str(folder),
                                                        "num_speculative_tokens": k, "adaptive_draft_length": False})
    outs = llm.generate(peaked["prompts"], SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True),
                        use_tqdm=False)
    return llm.stats()["mean_acceptance_length"], [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("mtp", {"num_layers": 2})])
def test_trained_drafter_lowers_the_loss_and_is_accepted_by_the_engine(peaked, tmp_path, method, extra):
    trainer = Trainer(_config(peaked, tmp_path / "run", method, **extra), progress=False)
    untrained = save_drafter(trainer.recipe.drafter, tmp_path / "untrained", method)
    trainer.train()
    trained = save_drafter(trainer.recipe.drafter, tmp_path / "trained", method)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    before, plain_like = _acceptance(peaked, untrained, method)
    after, outputs = _acceptance(peaked, trained, method)
    print(method, rows[0]["loss"], rows[-1]["loss"], before, after)
    assert after > before + 0.5, (before, after)  # greedy acceptance is deterministic: a real measurement
    assert outputs == plain_like  # lossless either way


def test_kill_9_mid_training_then_the_same_command_ends_with_the_same_weights(peaked, tmp_path):
    args = [sys.executable, "-m", "eyas.train", "eagle3", "--data", str(peaked["dumps"]), "--model",
            str(peaked["model"]), "--loss-masks", str(peaked["masks"]), "--layers", "0,1,2,3", "--draft-vocab-size",
            "64", "--unroll-steps", "2", "--epochs", "40", "--batch-tokens", "256", "--max-len", "64",
            "--checkpoint-every", "3", "--eval-prompts", "0", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*args, "--out", str(tmp_path / "whole")], check=True, env=env, capture_output=True)
    proc = subprocess.Popen([*args, "--out", str(tmp_path / "killed")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "checkpoint.pt"
    deadline = time.time() + 120
    while not checkpoint.is_file() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(checkpoint, weights_only=False)["step"]
    subprocess.run([*args, "--out", str(tmp_path / "killed")], check=True, env=env, capture_output=True)
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    resumed = torch.load(checkpoint, weights_only=False)
    assert 0 < killed_at < whole["step"] == resumed["step"]
    for name, tensor in whole["drafter"].items():
        assert torch.equal(tensor, resumed["drafter"][name]), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # rows past the last checkpoint of the killed run were dropped


def test_ddp_with_two_gloo_processes_equals_one_process(peaked, tmp_path):
    args = ["eagle3", "--data", str(peaked["dumps"]), "--model", str(peaked["model"]), "--loss-masks",
            str(peaked["masks"]), "--layers", "0,1,2,3", "--draft-vocab-size", "128", "--unroll-steps", "3",
            "--epochs", "2", "--batch-tokens", "1024", "--max-len", "64", "--eval-prompts", "0", "--threads", "1",
            "--autocast", "off"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "eyas.train", *args, "--out", str(tmp_path / "one")], check=True, env=env,
                   capture_output=True)
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    two = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "eyas.train", *args, "--out",
                          str(tmp_path / "two")], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)
    assert one["step"] == two["step"] >= 4  # the same plan: every batch has a sample for each rank
    last_one, last_two = (json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[-1])
                          for run in ("one", "two"))
    assert last_one["step_loss"] == pytest.approx(last_two["step_loss"], rel=1e-4)  # the same loss, step by step
    # AdamW normalises each update: a weight whose gradient is ~0 may move by up to lr either way on float
    # noise (the ranks sum gradients in another order), so weights agree within 2 * lr * steps
    bound = 2 * 1e-4 * one["step"]
    diffs = {name: float((tensor.double() - two["drafter"][name].double()).abs().max())
             for name, tensor in one["drafter"].items()}
    assert max(diffs.values()) <= bound, diffs


def test_export_layouts_reload_with_identical_drafts(peaked, tmp_path):
    trainer = Trainer(_config(peaked, tmp_path / "run", epochs=2), progress=False)
    trainer.train()
    drafter = trainer.recipe.drafter
    folders = {layout: save_drafter(drafter, tmp_path / layout, layout, verifier=str(peaked["model"]),
                                    num_speculative_tokens=3) for layout in ("eagle3", "speculators")}
    results = []
    for layout, folder in folders.items():
        loaded = load_drafter(folder, trainer.target, dtype=torch.float32, device=torch.device("cpu"),
                              max_positions=128, method="eagle3")
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), (layout, name)
        results.append(_acceptance(peaked, folder, "eagle3"))
    assert results[0] == results[1]
    # a speculators folder is a whole model: LLM(folder) finds its verifier and its k
    llm = LLM(str(folders["speculators"]))
    assert llm.engine.config.speculative.num_speculative_tokens == 3


def test_mtp_export_loads_with_per_step_layer_selection(peaked, tmp_path):
    trainer = Trainer(_config(peaked, tmp_path / "run", "mtp", num_layers=2, epochs=1), progress=False)
    trainer.train()
    folder = save_drafter(trainer.recipe.drafter, tmp_path / "mtp", "mtp")
    loaded = load_drafter(folder, trainer.target, dtype=torch.float32, device=torch.device("cpu"), max_positions=128,
                          method="mtp")
    assert loaded.num_step_layers == 2 and not loaded.advances_positions
    for name, tensor in trainer.recipe.drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def _expect_refusal(peaked, tmp_path, data: Path, match: str, **over) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=match):
        Trainer(_config(peaked, out, data=str(data), **over), progress=False)
    assert not out.exists()  # nothing written


def test_bad_input_is_refused_naming_the_file(peaked, tmp_path):
    files = sorted(peaked["dumps"].glob("*.safetensors"))
    # no layer N: the slots are layers 0, 1, 2 only
    no_final = tmp_path / "no_final"
    no_final.mkdir()
    for f in files:
        d = load_file(f)
        save_file({"hidden_states": d["hidden_states"][:, :3].contiguous(), "token_ids": d["token_ids"]}, no_final / f.name)
    _expect_refusal(peaked, tmp_path, no_final, r"not 3 \(the final layer.*--layers 0,1,2,3", layers=(0, 1, 2),
                    loss_masks=None)
    # hidden size of another model
    wide = tmp_path / "wide"
    wide.mkdir()
    for f in files:
        d = load_file(f)
        save_file({"hidden_states": torch.cat([d["hidden_states"]] * 2, -1), "token_ids": d["token_ids"]}, wide / f.name)
    _expect_refusal(peaked, tmp_path, wide, rf"{files[0].name}.*hidden size mismatch")
    # token ids past the vocabulary
    vocab = tmp_path / "vocab"
    shutil.copytree(peaked["dumps"], vocab)
    d = load_file(files[0])
    save_file({"hidden_states": d["hidden_states"], "token_ids": d["token_ids"] + 1000}, vocab / files[0].name)
    _expect_refusal(peaked, tmp_path, vocab, rf"{files[0].name}: token id .* outside the target's vocabulary")
    # a corrupt file
    corrupt = tmp_path / "corrupt"
    shutil.copytree(peaked["dumps"], corrupt)
    (corrupt / files[1].name).write_bytes(b"\x00garbage")
    _expect_refusal(peaked, tmp_path, corrupt, rf"{files[1].name} cannot be read as safetensors")
    # an empty dataset
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_refusal(peaked, tmp_path, empty, "no samples .* empty dataset", loss_masks=None)


def test_a_run_folder_with_other_settings_is_refused(peaked, tmp_path):
    Trainer(_config(peaked, tmp_path / "run", max_steps=1), progress=False).train()
    with pytest.raises(ValueError, match="other settings .*lr"):
        Trainer(_config(peaked, tmp_path / "run", lr=1e-3), progress=False).train()


def _write_chats(path: Path, n: int) -> Path:
    """n one-exchange conversations of different lengths, as a .jsonl of chat data."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"question {i} " * (i + 2)},
                                                           {"role": "assistant", "content": f"answer {i} " * (3 + i)}]})
                    + "\n")
    return path


def test_online_batches_equal_the_engine_dumps(tmp_path, tiny_models):
    """--online computes the target's states in the loop; they must equal what `eyas extract` dumps."""
    from eyas.jobs.extract import run_extract
    from eyas.model.tokenizer import Tokenizer
    from eyas.train.data import DumpData
    from eyas.train.online import OnlineData

    model = tiny_models["llama"]
    chats = _write_chats(tmp_path / "chats.jsonl", 5)
    # float32 weights, as the trainer's target (an HF folder's "auto" on a bf16 CPU would extract from bf16 rows)
    run_extract(str(chats), tmp_path / "dumps", model=str(model), layers=LAYERS, progress=False, dtype="float32")
    trainer_cfg = _config({"dumps": tmp_path / "dumps", "model": model, "masks": None}, tmp_path / "x",
                          loss_masks=None, layers=None)
    from eyas.config import ModelConfig
    from eyas.model.loader import load_model

    cfg = ModelConfig.from_folder(model)
    target = load_model(cfg, torch.float32, torch.device("cpu"), 256)
    dumps = DumpData(trainer_cfg.data, cfg, None)
    online = OnlineData((str(chats),), Tokenizer.from_folder(model), target, (0, 1, 2), max_len=256, max_samples=None)
    assert dumps.lengths(256) == online.lengths(256)
    a, b = dumps.batch([0, 3], 256, torch.float32), online.batch([0, 3], 256, torch.float32)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)
    within = torch.arange(a.token_ids.shape[1]) < torch.tensor(dumps.lengths(256))[[0, 3]].unsqueeze(1)  # [B, T]
    torch.testing.assert_close(a.aux[within], b.aux[within], rtol=1e-4, atol=1e-4)  # padding is never scored
    torch.testing.assert_close(a.last[within], b.last[within], rtol=1e-4, atol=1e-4)
    assert dict(dumps.frequencies) == dict(online.frequencies)


def test_online_reads_several_sources_as_one_dataset(tmp_path, tiny_models):
    """--online --data A B: the conversations of A then B, as if one file held both; --max-samples applies to
    each source; sources with nothing usable are refused by name."""
    from eyas.config import ModelConfig
    from eyas.model.loader import load_model
    from eyas.model.tokenizer import Tokenizer
    from eyas.train.online import OnlineData

    model = tiny_models["llama"]
    chats = [[{"role": "user", "content": f"question {i} " * (i + 2)}, {"role": "assistant", "content": f"answer {i} " * 3}]
             for i in range(5)]

    def write(path, items):
        with open(path, "w") as f:
            for i, messages in items:
                f.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
        return str(path)

    a = write(tmp_path / "a.jsonl", list(enumerate(chats))[:3])
    b = write(tmp_path / "b.jsonl", list(enumerate(chats))[3:])
    both = write(tmp_path / "both.jsonl", list(enumerate(chats)))
    first_two = write(tmp_path / "first_two.jsonl", [(0, chats[0]), (1, chats[1]), (3, chats[3]), (4, chats[4])])
    target = load_model(ModelConfig.from_folder(model), torch.float32, torch.device("cpu"), 256)
    tok = Tokenizer.from_folder(model)

    def read(data, max_samples=None):
        return OnlineData(data, tok, target, (0, 1, 2), max_len=256, max_samples=max_samples)

    two, one = read((a, b)), read((both,))
    assert two.rows == one.rows and len(two.rows) == 5 and dict(two.frequencies) == dict(one.frequencies)
    assert read((a, b), max_samples=2).rows == read((first_two,)).rows
    empty = write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no usable conversation in '.*empty.jsonl', '.*empty.jsonl'"):
        read((empty, empty))


def test_several_dump_folders_are_one_dataset(tmp_path, tiny_models):
    """--data A B: the samples of both folders in order, their token frequencies summed; folders holding
    other layers are refused by name."""
    from eyas.config import ModelConfig
    from eyas.jobs.extract import run_extract
    from eyas.train.data import DumpData

    model = tiny_models["llama"]
    for name, words, layers in (("a", "alpha beta", LAYERS), ("b", "gamma", LAYERS), ("c", "delta", [1, 3])):
        chats = tmp_path / f"{name}.jsonl"
        chats.write_text("".join(json.dumps({"id": str(i), "messages": [
            {"role": "user", "content": f"{words} {i}"}, {"role": "assistant", "content": f"{words} " * (i + 2)}]})
            + "\n" for i in range(3)))
        run_extract(str(chats), tmp_path / name, model=str(model), layers=layers, progress=False)
    cfg = ModelConfig.from_folder(model)
    a, b = DumpData(tmp_path / "a", cfg, None), DumpData(tmp_path / "b", cfg, None)
    both = DumpData([tmp_path / "a", tmp_path / "b"], cfg, None)
    assert both.samples == a.samples + b.samples
    assert both.frequencies == a.frequencies + b.frequencies
    assert torch.equal(both.batch([3], 64, torch.float32).last, b.batch([0], 64, torch.float32).last)
    with pytest.raises(ValueError, match=r"'.*c' hold layers \[1, 3\].*same layers"):
        DumpData([tmp_path / "a", tmp_path / "c"], cfg, None)
    assert TrainConfig(method="eagle3", data=str(tmp_path / "a"), out="x").data == (str(tmp_path / "a"),)


@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("mtp", {"num_layers": 2})])
def test_init_starts_from_a_drafter_folder_and_fine_tunes_it(peaked, tmp_path, method, extra):
    first = Trainer(_config(peaked, tmp_path / "first", method, epochs=4, **extra), progress=False)
    first.train()
    folder = save_drafter(first.recipe.drafter, tmp_path / "folder", method, dtype=torch.float32)
    # another vocabulary size is ignored: fine-tuning keeps the folder's draft vocabulary
    tuned = Trainer(_config(peaked, tmp_path / "tuned", method, epochs=4, init=str(folder), draft_vocab_size=100,
                            **extra), progress=False)
    start = {k: v.clone() for k, v in tuned.recipe.drafter.state_dict().items()}
    for name, tensor in first.recipe.drafter.state_dict().items():
        assert torch.equal(start[name], tensor), name
    before, _ = _acceptance(peaked, folder, method)
    tuned.train()
    after, _ = _acceptance(peaked, save_drafter(tuned.recipe.drafter, tmp_path / "after", method), method)
    rows = [json.loads(line) for line in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    fresh = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] < 0.5 * fresh[0]["loss"]  # it starts where the first run ended, not from scratch
    assert after >= before - 0.05, (before, after)
    with pytest.raises(ValueError, match="does not have this run's shape.*--num-layers"):
        Trainer(_config(peaked, tmp_path / "wrong", method, init=str(folder),
                        num_layers=3 if method == "mtp" else 2), progress=False)
    if method == "eagle3":
        with pytest.raises(ValueError, match=r"reads layers \[0, 1, 2\].*--aux-layer-ids 0,1,2"):
            Trainer(_config(peaked, tmp_path / "aux", method, init=str(folder), aux_layer_ids=(0, 2)), progress=False)
    with pytest.raises(ValueError, match="is not a .* drafter folder"):
        Trainer(_config(peaked, tmp_path / "missing", method, init=str(tmp_path / "nowhere")), progress=False)


def test_a_finished_run_run_again_keeps_the_rate_it_trained_at(peaked, tmp_path):
    """Re-running a finished command only exports (e.g. to measure acceptance): its card keeps the training rate."""
    Trainer(_config(peaked, tmp_path / "run", max_steps=2), progress=False).train()
    again = Trainer(_config(peaked, tmp_path / "run", max_steps=2), progress=False)
    again.train()
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert again.step == 2 and again.tokens_per_second == last["tokens_per_s"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("mtp", {"num_layers": 2})])
def test_training_on_cuda_matches_the_cpu_loss(peaked, tmp_path, method, extra):
    """The trainer's tensors all live on the run's device (an EAGLE-3 run once failed at its first step on CUDA:
    the draft vocabulary's arange on the CPU); in float32 its first losses equal the CPU run's."""
    losses = {}
    for device in ("cpu", "cuda"):
        trainer = Trainer(_config(peaked, tmp_path / device, method, max_steps=3, device=device, **extra), progress=False)
        trainer.train()
        rows = [json.loads(line) for line in (tmp_path / device / "metrics.jsonl").read_text().splitlines()]
        losses[device] = [r["loss"] for r in rows]
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)


def test_online_target_runs_under_the_trainers_autocast(tmp_path, tiny_models, monkeypatch):
    """With autocast on, --online computes the target's states under bf16 autocast too (half its cost on an AMX
    CPU): they stay within bf16 rounding of the float32 states, and the training step runs on them."""
    model = tiny_models["llama"]
    chats = _write_chats(tmp_path / "chats.jsonl", 4)
    trainer = Trainer(TrainConfig(method="eagle3", data=str(chats), out=str(tmp_path / "run"), model=str(model),
                                  online=True, draft_vocab_size=320, unroll_steps=2, batch_tokens=4096, max_len=256,
                                  autocast="on"), progress=False)
    seen = []  # (autocast on at the call, the batch) per call
    batch = trainer.data.batch

    def recorded(*args):
        seen.append((torch.is_autocast_enabled("cpu"), batch(*args)))
        return seen[-1][1]

    monkeypatch.setattr(trainer.data, "batch", recorded)
    row = trainer.train_step([0, 1, 2, 3])
    assert torch.isfinite(torch.tensor(row["loss"])) and row["tokens"] > 0
    (autocast, states), = seen
    assert autocast
    exact = batch([0, 1, 2, 3], 256, torch.float32)
    mask = exact.loss_mask
    assert not torch.equal(states.last[mask], exact.last[mask])  # bf16 products, not float32 ones
    torch.testing.assert_close(states.last[mask], exact.last[mask], rtol=0.05, atol=0.05)
    torch.testing.assert_close(states.aux[mask], exact.aux[mask], rtol=0.05, atol=0.05)
