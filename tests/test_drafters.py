"""EAGLE-1, EAGLE-3 and MTP drafters: public checkpoint layouts and paged drafting vs a dense reference.

Each drafter is built with random weights, saved in its public layout, loaded back, and run for k
greedy steps (a multi-token draft prefill, then single-token draft decode) through the SDPA
backend over a randomly filled paged cache, three requests of different lengths batched (one
longer than the backend's per-request threshold). The drafts and logits must equal those of
``drafter_reference``, which reads the saved files itself and computes in float64, one request at
a time, with dense attention.
"""

import dataclasses
import json
import logging
import shutil
from types import SimpleNamespace

import drafter_reference as ref
import pytest
import torch
import transformers
from engine_helpers import randomize_
from safetensors.torch import load_file, save_file

from eyas.config import ModelConfig
from eyas.model.attention import AttentionBatch
from eyas.model.attention.sdpa import SdpaBackend
from eyas.model.drafters import Eagle1Drafter, Eagle3Drafter, MtpDrafter, TargetParts, load_drafter, read_drafter_spec, save_drafter
from eyas.model.forward_context import ForwardContext, forward_context
from eyas.model.loader import load_model

BLOCK, NUM_BLOCKS, MAX_POS, K = 8, 40, 256, 4
PROMPT_LENS = (5, 12, 37)  # target hidden states per request (prefix length); 37 > the SDPA backend's LONG_QUERY
DRAFT_IDS = torch.sort(torch.randperm(320, generator=torch.Generator().manual_seed(9))[:200]).values


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("drafter_target") / "llama", "llama")
    cfg = ModelConfig.from_folder(path)
    model = load_model(cfg, torch.float32, torch.device("cpu"), MAX_POS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    requests = []
    for n in PROMPT_LENS:
        tokens = torch.randint(0, 320, (n + 1,), generator=gen).tolist()  # x0..x_n; hidden states at 0..n-1
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
        requests.append((tokens, [s[0] for s in states]))  # HF hidden_states[k] = aux id k; [N] = normed last
    return SimpleNamespace(path=path, cfg=cfg, model=model, requests=requests)


def _parts(target):
    return TargetParts(target.model.embed_tokens, target.model.lm_head)


def _eagle3(target, layout, num_layers=1, parallel_depths=0):
    """SafeAILab: drafter hidden = target's, shared embedding. speculators: hidden 48, own embedding."""
    own = layout == "speculators"
    cfg = dataclasses.replace(target.cfg, num_layers=num_layers, **(dict(hidden_size=48, head_dim=12, intermediate_size=96)
                                                          if own else {}))
    drafter = Eagle3Drafter(cfg, _parts(target), target_hidden_size=64, draft_vocab_size=200, aux_layer_ids=(2, 0, 1),
                            max_positions=MAX_POS, own_embedding=own, parallel_depths=parallel_depths,
                            mask_token_id=11)
    randomize_(drafter, seed=1)
    drafter.set_draft_vocabulary(DRAFT_IDS)
    return drafter


def _eagle1(target):
    cfg = dataclasses.replace(target.cfg, num_layers=1)
    return randomize_(Eagle1Drafter(cfg, _parts(target), fc_bias=True, max_positions=MAX_POS, own_embedding=False), 2)


def _mtp(target, windows, own_heads):
    drafter = MtpDrafter(target.cfg, _parts(target), sliding_windows=windows, own_heads=own_heads,
                         max_positions=MAX_POS)
    return randomize_(drafter, seed=3)


def _save_mtp(target, drafter, folder, into_target, gemma=False):
    if into_target:  # DeepSeek layout: MTP layers N.. next to the target's own weights
        shutil.copytree(target.path, folder)
    return save_drafter(drafter, folder, gemma_norms=gemma)


class PagedDrafter:
    """Runs drafter steps through the SDPA backend: one KV-cache group per attention layer, each with its
    own shuffled block table and a cache filled with noise (reading an unwritten slot shows)."""

    def __init__(self, drafter, gen):
        self.drafter, self.backend = drafter, SdpaBackend()
        width = -(-(max(PROMPT_LENS) + K) // BLOCK)
        self.tables = {}
        for group, layer in enumerate(drafter.attention_layers(), start=1):
            layer.kv_cache_group = group
            layer.kv_cache = torch.randn(2, NUM_BLOCKS * BLOCK, layer.num_kv_heads, layer.head_dim, generator=gen)
            blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:len(PROMPT_LENS) * width] + 1
            self.tables[group] = blocks.view(len(PROMPT_LENS), width)

    def step(self, step, input_ids, positions, hidden, q_lens):
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        seq_lens = positions[qsl[1:] - 1] + 1
        meta = {}
        for group, table in self.tables.items():
            slots = table[req, positions // BLOCK] * BLOCK + positions % BLOCK
            batch = AttentionBatch(qsl, seq_lens, table, slots, BLOCK, int(q_lens.max()), int(seq_lens.max()))
            meta[group] = self.backend.build_metadata(batch, torch.device("cpu"))
        with forward_context(ForwardContext(self.backend, meta)):
            return self.drafter(step, input_ids, positions, hidden)

    @torch.inference_mode()
    def greedy_chain(self, requests, k):
        """requests: (tokens x0..x_{L+1}, hidden [L+1, *]) -> drafts [R, k], logits [R, k, V]."""
        drafter = self.drafter
        q_lens = torch.tensor([len(h) for _, h in requests])
        input_ids = torch.cat([torch.tensor(t[1:]) for t, _ in requests])  # token t+1 pairs with hidden t
        positions = torch.cat([torch.arange(n) for n in q_lens.tolist()])
        hidden = torch.cat([h for _, h in requests])
        last = q_lens.cumsum(0) - 1
        for step in range(drafter.num_step_layers):  # draft prefill: fills every step layer's cache
            logits_hidden, feedback = self.step(step, input_ids, positions, hidden, q_lens)
            if step == 0:
                logits, feedback0 = [drafter.compute_logits(0, logits_hidden[last])], feedback[last]
        feedback, pos, ones = feedback0, positions[last], torch.ones_like(q_lens)
        for j in range(1, k):  # draft decode
            pos = pos + 1 if drafter.advances_positions else pos
            logits_hidden, feedback = self.step(j, logits[-1].argmax(-1), pos, feedback, ones)
            logits.append(drafter.compute_logits(j, logits_hidden))
        logits = torch.stack(logits, dim=1)
        return logits.argmax(-1), logits


def _inputs(target, hidden_of):
    return [(tokens, hidden_of(states)) for tokens, states in target.requests]


def _check_chain(drafter, reference, requests, select=None):
    drafts, logits = PagedDrafter(drafter, torch.Generator().manual_seed(5)).greedy_chain(requests, K)
    for r, (tokens, hidden) in enumerate(requests):
        want_drafts, want_logits = ref.greedy_chain(reference, tokens, hidden, K, select)
        assert drafts[r].tolist() == want_drafts
        torch.testing.assert_close(logits[r].double(), want_logits, rtol=1e-4, atol=1e-4)
    return drafts


def _assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_eagle3_drafts_match_reference(target, tmp_path, layout, num_layers):
    drafter = _eagle3(target, layout, num_layers)
    save_drafter(drafter, tmp_path / "d", layout, verifier=str(target.path), num_speculative_tokens=5)
    loaded = load_drafter(tmp_path / "d", target.model, dtype=torch.float32, device=torch.device("cpu"),
                          max_positions=MAX_POS)
    _assert_same_tensors(loaded.state_dict(), drafter.state_dict())
    spec = loaded.spec
    assert (spec.method, spec.layout, spec.aux_layer_ids, spec.draft_vocab_size) == ("eagle3", layout, (0, 1, 2), 200)
    assert (spec.hidden_size, spec.target_hidden_size) == (drafter.config.hidden_size, 64)
    assert (spec.num_speculative_tokens, spec.verifier) == ((5, str(target.path)) if layout == "speculators"
                                                            else (None, None))
    assert loaded.shares_target_embedding == (layout == "eagle3") and not loaded.shares_target_head
    assert (loaded.target_hidden, loaded.advances_positions, loaded.num_step_layers) == ("aux", True, 1)
    assert len(loaded.attention_layers()) == num_layers == spec.config.get("transformer_layer_config", spec.config)[
        "num_hidden_layers"]
    if num_layers > 1:  # vLLM's names: layer 0 as the layout has it, the others as plain layers.{i}
        assert "layers.1.self_attn.q_proj.weight" in load_file(tmp_path / "d" / "model.safetensors")
    # step 0 reads the aux states in ascending layer order, concatenated
    requests = _inputs(target, lambda states: torch.cat([states[i] for i in spec.aux_layer_ids], dim=-1))
    embed = None if layout == "speculators" else target.model.embed_tokens.weight.detach()
    drafts = _check_chain(loaded, ref.Eagle3(tmp_path / "d", embed), requests)
    assert bool(torch.isin(drafts, DRAFT_IDS).all())  # every draft is a target id of the draft vocabulary
    save_drafter(loaded, tmp_path / "again", layout, verifier=str(target.path), num_speculative_tokens=5)
    _assert_same_tensors(load_file(tmp_path / "again" / "model.safetensors"),
                         load_file(tmp_path / "d" / "model.safetensors"))
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == spec.config


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_parallel_drafter_export_round_trip(target, tmp_path, layout):
    """A parallel (P-EAGLE) drafter saved and loaded back: the same tensors (``mask_hidden`` [1, 3 * Ht]
    included), depth count and mask token under vLLM's names (``ptd_token_id``; speculators: ``peagle`` with
    ``mask_token_id``), and saving the loaded drafter writes the same files."""
    drafter = _eagle3(target, layout, parallel_depths=6)
    save_drafter(drafter, tmp_path / "d", layout, verifier=str(target.path), num_speculative_tokens=5)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    if layout == "speculators":
        assert (config["speculators_model_type"], config["mask_token_id"]) == ("peagle", 11)
        assert config["speculators_config"]["algorithm"] == "peagle"
    else:
        assert config["ptd_token_id"] == 11
    assert config["parallel_drafting_depths"] == 6
    files = load_file(tmp_path / "d" / "model.safetensors")
    assert files["mask_hidden"].shape == (1, 3 * 64)
    loaded = load_drafter(tmp_path / "d", target.model, dtype=torch.float32, device=torch.device("cpu"),
                          max_positions=MAX_POS)
    _assert_same_tensors(loaded.state_dict(), drafter.state_dict())
    assert (loaded.parallel_depths, loaded.mask_token_id) == (6, 11)
    assert (loaded.spec.parallel_depths, loaded.spec.mask_token_id) == (6, 11)
    save_drafter(loaded, tmp_path / "again", layout, verifier=str(target.path), num_speculative_tokens=5)
    _assert_same_tensors(load_file(tmp_path / "again" / "model.safetensors"), files)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


def test_eagle1_drafts_match_reference(target, tmp_path):
    drafter = _eagle1(target)
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    del config["bias"]  # old checkpoints name no bias: fc has one
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path / "d", target.model, dtype=torch.float32, device=torch.device("cpu"),
                          max_positions=MAX_POS, method="eagle")
    _assert_same_tensors(loaded.state_dict(), drafter.state_dict())
    assert loaded.fc.bias is not None and loaded.shares_target_head and loaded.shares_target_embedding
    assert loaded.target.lm_head is target.model.lm_head  # shared, not copied
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in loaded.state_dict())
    assert (loaded.target_hidden, loaded.spec.aux_layer_ids) == ("last", ())
    requests = _inputs(target, lambda states: states[-1])  # the target's last hidden state (after its norm)
    reference = ref.Eagle1(tmp_path / "d", target.model.embed_tokens.weight.detach(),
                           target.model.lm_head.weight.detach())
    _check_chain(loaded, reference, requests)
    # the original EAGLE-1 checkpoints are pytorch_model.bin files
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "d" / "config.json", tmp_path / "bin")
    torch.save(load_file(tmp_path / "d" / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    from_bin = load_drafter(tmp_path / "bin", target.model, dtype=torch.float32, device=torch.device("cpu"),
                            max_positions=MAX_POS, method="eagle")
    _assert_same_tensors(from_bin.state_dict(), drafter.state_dict())


MTP_CASES = {  # windows per MTP layer, own heads, in the target's folder, Gemma-style norms
    "deepseek_1": ((None,), False, True, False),
    "2_layers_sliding_and_full": ((64, None), False, True, False),
    "3_layers_own_heads_gemma": ((None, 64, None), True, False, True),
}


@pytest.mark.parametrize("case", list(MTP_CASES))
def test_mtp_drafts_match_reference_with_per_step_layers(target, tmp_path, case):
    windows, own_heads, into_target, gemma = MTP_CASES[case]
    drafter = _mtp(target, windows, own_heads)
    folder = _save_mtp(target, drafter, tmp_path / "d", into_target, gemma)
    loaded = load_drafter(folder, target.model, dtype=torch.float32, device=torch.device("cpu"), max_positions=MAX_POS)
    _assert_same_tensors(loaded.state_dict(), drafter.state_dict())
    m = len(windows)
    assert (loaded.spec.method, loaded.num_step_layers, loaded.advances_positions) == ("mtp", m, m == 1)
    assert loaded.shares_target_head == (not own_heads) and loaded.shares_target_embedding
    assert [a.sliding_window for a in loaded.attention_layers()] == list(windows)
    assert [a.layer_id for a in loaded.attention_layers()] == [target.cfg.num_layers + i for i in range(m)]
    if into_target:  # the target still loads from its folder, MTP layers ignored
        load_model(ModelConfig.from_folder(folder), torch.float32, torch.device("cpu"), MAX_POS)
    requests = _inputs(target, lambda states: states[-1])
    reference = ref.Mtp(folder, target.model.embed_tokens.weight.detach(), target.model.lm_head.weight.detach())
    drafts = _check_chain(loaded, reference, requests)
    if m > 1:  # step j used layer j % m: always using layer 0 drafts other tokens
        wrong = [ref.greedy_chain(reference, t, h, K, select=lambda j: 0)[0] for t, h in requests]
        assert drafts.tolist() != wrong
    save_drafter(loaded, tmp_path / "again", gemma_norms=gemma)
    _assert_same_tensors(load_file(tmp_path / "again" / "model.safetensors"),
                         load_file(folder / ("mtp.safetensors" if into_target else "model.safetensors")))


def test_d2t_maps_draft_ids_to_target_ids(target):
    drafter = _eagle3(target, "eagle3")
    assert torch.equal(drafter.d2t, DRAFT_IDS - torch.arange(200)) and int(drafter.t2d.sum()) == 200
    assert torch.equal(drafter.t2d.nonzero().squeeze(1), DRAFT_IDS)
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, draft = drafter.compute_logits(0, hidden), drafter.lm_head(hidden)  # [6, V], [6, Vd]
    torch.testing.assert_close(logits[:, DRAFT_IDS], draft)
    assert bool(torch.isneginf(logits[:, ~drafter.t2d]).all())
    assert torch.equal(logits.argmax(-1), DRAFT_IDS[draft.argmax(-1)])


def test_specforge_aux_ids_convert_and_missing_ids_warn(target, tmp_path, caplog):
    save_drafter(_eagle3(target, "eagle3"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(aux_layer_convention="specforge", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 0, 1]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_drafter_spec(tmp_path, target.cfg).aux_layer_ids == (1, 2, 3)  # output of layer k = input of k+1
    del config["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="eyas"):
        assert read_drafter_spec(tmp_path, target.cfg).aux_layer_ids == (0, 1, 2)  # (2, N//2, N-3), N = 3
    assert "names no aux layer ids" in caplog.text and "(2, 1, 0)" in caplog.text


def _edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _edit_tensors(fn):
    def edit(folder):
        tensors = load_file(folder / "model.safetensors")
        fn(tensors)
        save_file(tensors, folder / "model.safetensors")
    return edit


def _bad_t2d(tensors):
    tensors["t2d"][DRAFT_IDS[0]] = False


BAD_CHECKPOINTS = [  # (base folder, edit, method, message)
    ("eagle3", _edit_config(target_hidden_size=96), None, r"target_hidden_size 96 does not match the target's hidden "
                                                          r"size 64 \(drafter: .*config.json"),
    ("eagle3", _edit_config(vocab_size=300), None, r"vocab_size 300 does not match the target's vocabulary size 320"),
    ("eagle3", _edit_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}), None,
     r"layer id 7 in .*config.json is outside \[0, 3\] for the 3-layer target"),
    ("eagle3", _edit_config(aux_layer_convention="specforge", eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                                            [0, 1, 3]}), None,
     r"layer id 3 \(specforge convention: 4 in vLLM's\) in .* is outside \[0, 3\]"),
    ("eagle3", _edit_config(aux_layer_convention="hf"), None, r"aux_layer_convention 'hf' in .* is not one of"),
    ("eagle3", _edit_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2]}), None,
     r"names 2 layers \(128 fc inputs .*\) but fc.weight in .* takes 192"),
    ("eagle3", _edit_config(draft_vocab_size=400), None, r"draft_vocab_size 400 in .* must be in \[1, 320\]"),
    ("eagle3", _edit_tensors(lambda t: t.pop("d2t")), None,
     r"tensor 'd2t' missing from .*: draft_vocab_size 200 differs from the target vocabulary size 320"),
    ("eagle3", _edit_tensors(lambda t: t.pop("norm.weight")), None, r"1 tensors missing from .*\['norm.weight'\]"),
    ("eagle3", _edit_tensors(lambda t: t.update(extra=torch.zeros(2))), None, r"unexpected tensors in .*\['extra'\]"),
    ("eagle3", _edit_tensors(lambda t: t.update({"norm.weight": torch.ones(3)})), None,
     r"tensor 'norm.weight' in .* has shape \(3,\), expected \(64,\)"),
    ("eagle3", _edit_tensors(lambda t: t["d2t"].fill_(200)), None, r"d2t in .* must map the draft ids to ascending"),
    ("eagle3", _edit_tensors(_bad_t2d), None, r"t2d in .* does not mark exactly the 200 target ids"),
    ("eagle3", _edit_config(), "mtp", r"method 'mtp' does not match .*config.json, a 'eagle3' checkpoint"),
    ("eagle3", _edit_config(), "medusa", r"method 'medusa' is not one of"),
    ("eagle3", lambda folder: (folder / "config.json").unlink(), None, r"no config.json in"),
    ("eagle3", lambda folder: (folder / "model.safetensors").unlink(), None, r"no \*.safetensors weights in"),
    # parallel drafters: the depth count, the mask token (vLLM's names) and mask_hidden, named with the file
    ("peagle", _edit_config(parallel_drafting_depths=1), None,
     r"parallel_drafting_depths 1 in .*config.json must be the int K >= 2 .*ptd_token_id marks it as one"),
    ("peagle", _edit_config(parallel_drafting_depths=None), None, r"parallel_drafting_depths None in .*config.json"),
    ("peagle", _edit_config(ptd_token_id=None), None,
     r"a parallel drafter needs its mask token id: none of ptd_token_id, pard_token, mask_token_id in .*config.json"),
    ("peagle", _edit_config(ptd_token_id=320), None, r"ptd_token_id 320 in .*config.json must be a token id in \[0, 320\)"),
    ("peagle", _edit_tensors(lambda t: t.update(mask_hidden=torch.zeros(1, 128))), None,
     r"tensor 'mask_hidden' in .*model.safetensors has shape \(1, 128\), expected \(1, 192\)"),
    ("peagle", _edit_tensors(lambda t: t.pop("mask_hidden")), None, r"1 tensors missing from .*\['mask_hidden'\]"),
    ("peagle", _edit_config(target_hidden_size=96), None, r"target_hidden_size 96 does not match the target's hidden"),
    ("peagle", _edit_config(vocab_size=300), None, r"vocab_size 300 does not match the target's vocabulary size 320"),
    ("speculators", _edit_config(norm_before_residual=True), None, r"norm_before_residual: true in .* is not supported"),
    ("speculators", _edit_config(speculators_model_type="eagle"), None, r"speculators_model_type 'eagle' in .* is not"),
    ("speculators", _edit_config(draft_vocab_size=None), None, r"field 'draft_vocab_size' missing from .*config.json"),
    ("speculators", _edit_tensors(lambda t: t.pop("embed_tokens.weight")), None,
     r"hidden_size 48 differs from the target's 64 and .* has no embed_tokens.weight"),
    ("eagle", _edit_config(hidden_size=32), "eagle", r"hidden_size 32 does not match the target's hidden size 64"),
    ("eagle", _edit_config(), None, r"none of speculators_model_type .* needs method='eagle'"),
    ("eagle", _edit_config(bias=False), "eagle", r"unexpected tensors in .*\['fc.bias'\]"),
    ("mtp", _edit_config(mtp_layer_types=["full_attention"]), None, r"mtp_layer_types \['full_attention'\] in .* "
                                                                    r"must list .* for each of the 2 MTP layers"),
    ("mtp", _edit_config(mtp_sliding_window=None), None, r"mtp_sliding_window None in .* must be an int >= 1"),
]


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    save_drafter(_eagle3(target, "eagle3"), root / "eagle3")
    save_drafter(_eagle3(target, "eagle3", parallel_depths=4), root / "peagle")
    save_drafter(_eagle3(target, "speculators"), root / "speculators", "speculators")
    save_drafter(_eagle1(target), root / "eagle")
    _save_mtp(target, _mtp(target, (64, None), own_heads=False), root / "mtp", into_target=False)
    return root


@pytest.mark.parametrize("base, edit, method, message", BAD_CHECKPOINTS,
                         ids=[f"{b}-{m.split(' ')[0]}-{i}" for i, (b, _, _, m) in enumerate(BAD_CHECKPOINTS)])
def test_bad_checkpoints_raise_actionable_errors(target, saved, tmp_path, base, edit, method, message):
    folder = shutil.copytree(saved / base, tmp_path / base)
    edit(folder)
    with pytest.raises(ValueError, match=message):
        load_drafter(folder, target.model, dtype=torch.float32, device=torch.device("cpu"), max_positions=MAX_POS,
                     method=method)


def test_save_errors(target, tmp_path):
    with pytest.raises(ValueError, match=r"layout: 'speculators' is not a layout of eagle drafters"):
        save_drafter(_eagle1(target), tmp_path / "e", "speculators")
    with pytest.raises(ValueError, match=r"MTP layers with different windows \[32, 64\]"):
        save_drafter(_mtp(target, (32, 64), own_heads=False), tmp_path / "m")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"num_hidden_layers": 5}))
    with pytest.raises(ValueError, match=r"the target in .* has 5 layers, the MTP drafter was built for 3"):
        save_drafter(_mtp(target, (None,), own_heads=False), tmp_path / "t")
