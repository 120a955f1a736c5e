"""Read drafter checkpoints in the public layouts (``shared/docs/formats.md``), validated at the edge.

Layouts, recognised from ``config.json``:

* ``speculators``: has ``speculators_model_type`` (``"eagle3"``, or ``"peagle"`` for a parallel
  drafter); the layer config is ``transformer_layer_config``, weights ``layers.0.*``; gives the default
  k and the verifier.
* ``eagle3`` (SafeAILab / SpecForge): has ``draft_vocab_size``; weights ``midlayer.*``.
* ``mtp``: has ``num_nextn_predict_layers`` (DeepSeek): MTP layer i is decoder layer N + i
  (``model.layers.{N+i}.*``), in the target's own folder or a separate one with the same names.
* ``eagle`` (EAGLE-1): a plain one-layer Llama config; recognised only when asked for with
  ``method="eagle"``.

Config keys eyas defines, writes, and reads:

* ``aux_layer_convention``: ``"vllm"`` (the default when absent: id k = the stream entering layer
  k) or ``"specforge"`` (id k = the output of layer k, read as k + 1). eyas writes ``"vllm"``.
* ``mtp_layer_types``: per MTP layer ``"full_attention"`` or ``"sliding_attention"`` (window:
  ``mtp_sliding_window``, its own key so that the target's ``sliding_window`` is left alone);
  absent = all full attention.
* ``mtp_gemma_norm``: true when the MTP layers' RMSNorm weights ``w`` scale by ``(1 + w)``
  (Gemma style); eyas adds 1 when reading and subtracts it when writing.

* ``parallel_drafting_depths``: K, the depths a parallel (P-EAGLE) drafter was trained for: it drafts
  at most K tokens per pass. Its mask token id is read from vLLM's names, first found of
  ``ptd_token_id``, ``pard_token``, ``mask_token_id`` (speculators' ``peagle`` name); its
  ``mask_hidden`` tensor ``[1, n_aux * Ht]`` is required. A folder with a mask token id but no depth
  count, or the other way round, is refused (docs/parallel_drafting.md).

Optional tensors decide what is shared with the target: without ``embed_tokens.weight`` an
EAGLE drafter shares the target's embedding; without ``shared_head.head.weight`` MTP layers share
its lm_head. An MTP layer's ``embed_tokens.weight`` (a DeepSeek copy) is ignored: the target's
embedding is always used.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.config import ModelConfig
from eyas.model.drafters.base import Drafter, TargetParts
from eyas.model.drafters.eagle1 import Eagle1Drafter
from eyas.model.drafters.eagle3 import Eagle3Drafter
from eyas.model.drafters.layout import LAYOUTS, UNMARKED, TensorFiles, checkpoint_names, is_norm_weight, prefix_renames
from eyas.model.drafters.mtp import MtpDrafter
from eyas.model.layers import RotaryEmbedding
from eyas.model.loader import linears_to_int8, materialize, set_matmul_precision

logger = logging.getLogger("eyas")
CONVENTIONS = ("vllm", "specforge")
UNSUPPORTED_FLAGS = ("norm_before_residual", "fc_norm")  # speculators variants of the EAGLE-3 layer


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter checkpoint declares, checked against the target."""

    method: str  # "eagle", "eagle3", "mtp"
    layout: str  # "eagle3" (SafeAILab/SpecForge), "speculators", "eagle", "mtp"
    path: Path
    config: dict  # the parsed config.json
    aux_layer_ids: tuple[int, ...]  # vLLM convention, ascending; () for EAGLE-1 and MTP
    num_speculative_tokens: int | None  # the checkpoint's default k (speculators), else None
    verifier: str | None  # the target the checkpoint was trained for (speculators), else None
    vocab_size: int  # the target's
    draft_vocab_size: int
    hidden_size: int  # the drafter's
    target_hidden_size: int
    num_mtp_layers: int = 0
    parallel_depths: int = 0  # K of a parallel (P-EAGLE) drafter, 0 for a chain drafter
    mask_token_id: int = 0  # the token its depths >= 1 are fed (parallel drafters)

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"


def read_drafter_spec(path: str | os.PathLike, target: ModelConfig, method: str | None = None) -> DrafterSpec:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"drafter: no config.json in '{path}'")
    hf = json.loads(config_file.read_text())
    layout = _layout(hf, method, config_file)
    if layout == "mtp":
        cfg, m = ModelConfig.from_folder(path), hf["num_nextn_predict_layers"]
        _check_target(cfg.hidden_size, cfg.vocab_size, "hidden_size", target, config_file)
        return DrafterSpec("mtp", layout, path, hf, (), None, None, cfg.vocab_size, cfg.vocab_size,
                           cfg.hidden_size, cfg.hidden_size, m)
    layer = hf.get("transformer_layer_config", {}) if layout == "speculators" else hf
    cfg = layer_config(layer, path)
    if layout == "eagle":
        _check_target(cfg.hidden_size, cfg.vocab_size, "hidden_size", target, config_file)
        return DrafterSpec("eagle", layout, path, hf, (), None, None, cfg.vocab_size, cfg.vocab_size,
                           cfg.hidden_size, cfg.hidden_size)
    for flag in UNSUPPORTED_FLAGS:
        if hf.get(flag):
            raise ValueError(f"drafter: {flag}: true in {config_file} is not supported (only the EAGLE-3 layer of "
                             f"formats.md, with {flag} false)")
    target_hidden = hf.get("target_hidden_size") or cfg.hidden_size
    field = "target_hidden_size" if hf.get("target_hidden_size") else "hidden_size"
    _check_target(target_hidden, cfg.vocab_size, field, target, config_file)
    draft_vocab = _required(hf, "draft_vocab_size", config_file)
    if not 1 <= draft_vocab <= cfg.vocab_size:
        raise ValueError(f"drafter: draft_vocab_size {draft_vocab} in {config_file} must be in [1, {cfg.vocab_size}] "
                         f"(the target vocabulary)")
    proposals = hf.get("speculators_config", {}).get("proposal_methods") or [{}]
    verifier = hf.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    depths, mask_token = _parallel_drafting(hf, cfg.vocab_size, config_file)
    return DrafterSpec("eagle3", layout, path, hf, _aux_layer_ids(hf, target.num_layers, config_file),
                       proposals[0].get("speculative_tokens"), verifier, cfg.vocab_size, draft_vocab,
                       cfg.hidden_size, target_hidden, parallel_depths=depths, mask_token_id=mask_token)


def load_drafter(path: str | os.PathLike, target: torch.nn.Module, *, dtype: torch.dtype, device: torch.device,
                 max_positions: int, method: str | None = None, matmul_precision: str | None = None) -> Drafter:
    """Build the drafter of a checkpoint folder next to a loaded target (eyas ``LlamaForCausalLM``).

    The target's embedding (and head, where shared) are used in place, never copied. ``matmul_precision``
    (a target on eyas's CPU kernels): the drafter's own matrices are held as Q8_0 blocks (int8, a float16 scale
    per 32 weights) and multiplied at "low" where the target is (int8 activations, none split: the drafts only
    propose), else at "highest". A draft step reads each weight once, so it reads about a quarter of float32's
    bytes (half of bfloat16's): the shipped EAGLE-3 drafter's step took 3.1 ms instead of 4.6 with bfloat16
    rows (1 thread). At "low" the blocks take the interleaved VNNI products: a catch-up over 300 prompt rows
    (``eyas.spec_decode.catch_up``) ran its five products in 13.4 ms against 27.9 ms for per-row int8 at
    "highest" (one Zen 4 thread), at the same acceptance (1.54 at k = 1, 2.01 at k = 3 on 16 held-out
    prompts). The drafts can differ from the unrounded drafter's where its top two logits nearly tie;
    verification keeps the output the target's either way.
    """
    spec = read_drafter_spec(path, target.config, method)
    files = TensorFiles(spec.path)
    parts = TargetParts(target.embed_tokens, target.lm_head)
    with torch.device("meta"):
        drafter = _build(spec, files, parts, max_positions)
    materialize(drafter, device)
    cfg = drafter.config  # materialize leaves the rotary tables uninitialised: rebuild them
    drafter.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    _fill(drafter, spec, files)
    drafter.spec = spec
    drafter = drafter.to(dtype).eval()
    if matmul_precision is not None:
        linears_to_int8(drafter, "Q8_0")
        if matmul_precision == "low":
            set_matmul_precision(drafter, "low", split_attention=False)
    return drafter


def layer_config(hf: dict, path: Path) -> ModelConfig:
    """A drafter layer's Llama config dict as a ModelConfig (``num_layers`` as written, usually 1)."""
    file = path / "config.json"
    heads, hidden = _required(hf, "num_attention_heads", file), _required(hf, "hidden_size", file)
    return ModelConfig(
        path=path, architecture=(hf.get("architectures") or ["LlamaForCausalLM"])[0],
        vocab_size=_required(hf, "vocab_size", file), hidden_size=hidden,
        intermediate_size=_required(hf, "intermediate_size", file), num_layers=hf.get("num_hidden_layers", 1),
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096), tie_word_embeddings=False,
        attention_bias=hf.get("attention_bias", False), rope_scaling=hf.get("rope_scaling"))


MASK_TOKEN_KEYS = ("ptd_token_id", "pard_token", "mask_token_id")  # vLLM's order; speculators writes the last


def _parallel_drafting(hf: dict, vocab_size: int, file: Path) -> tuple[int, int]:
    """(depths K, mask token id) of a parallel drafter's config, (0, 0) for a chain drafter."""
    key = next((k for k in MASK_TOKEN_KEYS if hf.get(k) is not None), None)
    depths = hf.get("parallel_drafting_depths")
    if key is None and depths is None and hf.get("speculators_model_type") != "peagle":
        return 0, 0
    if key is None:
        raise ValueError(f"drafter: a parallel drafter needs its mask token id: none of {', '.join(MASK_TOKEN_KEYS)} "
                         f"in {file}")
    token = hf[key]
    if isinstance(token, str) and token.isdigit():  # some exports write it as a string
        token = int(token)
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
        raise ValueError(f"drafter: {key} {token!r} in {file} must be a token id in [0, {vocab_size})")
    if not isinstance(depths, int) or isinstance(depths, bool) or depths < 2:
        raise ValueError(f"drafter: parallel_drafting_depths {depths!r} in {file} must be the int K >= 2 of depths "
                         f"the parallel drafter was trained for ({key} marks it as one)")
    return depths, token


def _layout(hf: dict, method: str | None, config_file: Path) -> str:
    if method is not None and method not in LAYOUTS.values():
        raise ValueError(f"drafter: method '{method}' is not one of {', '.join(map(repr, sorted(set(LAYOUTS.values()))))}")
    if "speculators_model_type" in hf:
        if hf["speculators_model_type"] not in ("eagle3", "peagle"):
            raise ValueError(f"drafter: speculators_model_type '{hf['speculators_model_type']}' in {config_file} "
                             f"is not supported (supported: 'eagle3', 'peagle')")
        found = "speculators"
    elif "draft_vocab_size" in hf:
        found = "eagle3"
    elif hf.get("num_nextn_predict_layers"):
        found = "mtp"
    elif method in UNMARKED:
        found = UNMARKED[method]
    else:
        raise ValueError(f"drafter: {config_file} has none of speculators_model_type (speculators EAGLE-3), "
                         f"draft_vocab_size (EAGLE-3) or num_nextn_predict_layers > 0 (MTP); an EAGLE-1 folder "
                         f"needs method='eagle'")
    if method is not None and LAYOUTS[found] != method:
        raise ValueError(f"drafter: method '{method}' does not match {config_file}, a '{LAYOUTS[found]}' "
                         f"checkpoint ({found} layout)")
    return found


def _required(hf: dict, key: str, file: Path):
    if key not in hf:
        raise ValueError(f"drafter: field '{key}' missing from {file}")
    return hf[key]


def _check_target(hidden: int, vocab: int, field: str, target: ModelConfig, file: Path) -> None:
    if hidden != target.hidden_size:
        raise ValueError(f"drafter: {field} {hidden} does not match the target's hidden size {target.hidden_size} "
                         f"(drafter: {file}, target: {target.path})")
    if vocab != target.vocab_size:
        raise ValueError(f"drafter: vocab_size {vocab} does not match the target's vocabulary size "
                         f"{target.vocab_size} (drafter: {file}, target: {target.path}); a drafter must share "
                         f"the target's tokenizer")


def _aux_layer_ids(hf: dict, num_layers: int, file: Path) -> tuple[int, ...]:
    """The aux layer ids in the vLLM convention, ascending; the default (2, N//2, N-3) with a warning."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or hf.get("eagle_aux_hidden_state_layer_ids")
    convention = hf.get("aux_layer_convention", "vllm")
    if convention not in CONVENTIONS:
        raise ValueError(f"drafter: aux_layer_convention '{convention}' in {file} is not one of "
                         f"{', '.join(map(repr, CONVENTIONS))}")
    if not ids:
        default = (2, num_layers // 2, num_layers - 3)
        logger.warning("drafter %s names no aux layer ids (eagle_aux_hidden_state_layer_ids): using the default %s "
                       "for the %d-layer target (vLLM convention). A drafter trained on other layers accepts almost "
                       "nothing; name its layers in config.json", file, default, num_layers)
        ids, convention = default, "vllm"
    shift = CONVENTIONS.index(convention)  # specforge: the output of layer k is the stream entering k + 1
    for raw in ids:
        if not 0 <= raw + shift <= num_layers:
            note = f" ({convention} convention: {raw + shift} in vLLM's)" if shift else ""
            raise ValueError(f"drafter: eagle_aux_hidden_state_layer_ids: layer id {raw}{note} in {file} is outside "
                             f"[0, {num_layers}] for the {num_layers}-layer target (0 = embeddings, {num_layers} = "
                             f"after the last layer)")
    return tuple(sorted(raw + shift for raw in ids))


def _build_mtp(spec: DrafterSpec, files: TensorFiles, parts: TargetParts, max_positions: int) -> Drafter:
    cfg = ModelConfig.from_folder(spec.path)
    windows = _mtp_windows(spec.config, spec.num_mtp_layers, spec.config_file)
    own_heads = f"model.layers.{cfg.num_layers}.shared_head.head.weight" in files
    return MtpDrafter(cfg, parts, sliding_windows=windows, own_heads=own_heads, max_positions=max_positions)


def _build_eagle1(spec: DrafterSpec, files: TensorFiles, parts: TargetParts, max_positions: int) -> Drafter:
    return Eagle1Drafter(layer_config(spec.config, spec.path), parts, fc_bias=spec.config.get("bias", True),
                         max_positions=max_positions, own_embedding="embed_tokens.weight" in files)


def _build_eagle3(spec: DrafterSpec, files: TensorFiles, parts: TargetParts, max_positions: int) -> Drafter:
    hf, file = spec.config, spec.config_file
    cfg = layer_config(hf.get("transformer_layer_config", hf), spec.path)
    own_embedding = "embed_tokens.weight" in files
    if not own_embedding and spec.hidden_size != spec.target_hidden_size:
        raise ValueError(f"drafter: hidden_size {spec.hidden_size} differs from the target's {spec.target_hidden_size} "
                         f"and {spec.path} has no embed_tokens.weight of its own (drafter: {file})")
    if "d2t" not in files and spec.draft_vocab_size != spec.vocab_size:
        raise ValueError(f"drafter: tensor 'd2t' missing from {spec.path}: draft_vocab_size {spec.draft_vocab_size} "
                         f"differs from the target vocabulary size {spec.vocab_size}, so the draft-to-target id map "
                         f"is required (drafter: {file})")
    fc_inputs = len(spec.aux_layer_ids) * spec.target_hidden_size
    fc_width = files.get("fc.weight").shape[-1] if "fc.weight" in files else fc_inputs
    if fc_width != fc_inputs:
        raise ValueError(f"drafter: eagle_aux_hidden_state_layer_ids names {len(spec.aux_layer_ids)} layers "
                         f"({fc_inputs} fc inputs at target_hidden_size {spec.target_hidden_size}) but fc.weight in "
                         f"{files.where['fc.weight']} takes {fc_width} (drafter: {file})")
    return Eagle3Drafter(cfg, parts, target_hidden_size=spec.target_hidden_size,
                         draft_vocab_size=spec.draft_vocab_size, aux_layer_ids=spec.aux_layer_ids,
                         max_positions=max_positions, own_embedding=own_embedding,
                         parallel_depths=spec.parallel_depths, mask_token_id=spec.mask_token_id)


_BUILDERS = {"mtp": _build_mtp, "eagle": _build_eagle1, "eagle3": _build_eagle3}  # method -> network builder


def _build(spec: DrafterSpec, files: TensorFiles, parts: TargetParts, max_positions: int) -> Drafter:
    return _BUILDERS[spec.method](spec, files, parts, max_positions)


def _mtp_windows(hf: dict, num_mtp_layers: int, file: Path) -> tuple[int | None, ...]:
    types = hf.get("mtp_layer_types") or ["full_attention"] * num_mtp_layers
    if len(types) != num_mtp_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"drafter: mtp_layer_types {types} in {file} must list 'full_attention' or "
                         f"'sliding_attention' for each of the {num_mtp_layers} MTP layers")
    window = hf.get("mtp_sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"drafter: mtp_sliding_window {window!r} in {file} must be an int >= 1 for the "
                         f"'sliding_attention' MTP layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _fill(drafter: Drafter, spec: DrafterSpec, files: TensorFiles) -> None:
    """Copy every checkpoint tensor into the drafter; a missing or misshapen tensor is an error."""
    renames = prefix_renames(spec.layout, drafter.config.num_layers, spec.num_mtp_layers)
    gemma = bool(spec.config.get("mtp_gemma_norm"))  # an MTP-layout key
    missing, used = [], set()
    state = drafter.state_dict()
    derived = {"t2d"} | ({"d2t"} if spec.draft_vocab_size == spec.vocab_size else set())
    for name, param in state.items():
        names = checkpoint_names(name, renames)
        if any(n not in files for n in names):
            if name in derived and names[0] not in files:
                continue
            missing += [n for n in names if n not in files]
            continue
        tensor = torch.cat([files.get(n) for n in names]) if len(names) > 1 else files.get(names[0])
        if param.shape != tensor.shape:
            raise ValueError(f"drafter: tensor '{names[0]}' in {files.where[names[0]]} has shape "
                             f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor + 1 if gemma and is_norm_weight(name) else tensor)
        used.update(names)
    if missing:
        raise ValueError(f"drafter: {len(missing)} tensors missing from {spec.path}, e.g. {missing[:3]} "
                         f"({spec.layout} layout)")
    unexpected = sorted(set(files.where) - used - {"t2d", "d2t"})
    if unexpected and drafter.owns_checkpoint_files:
        raise ValueError(f"drafter: unexpected tensors in {spec.path}, e.g. {unexpected[:3]} ({spec.layout} layout)")
    if isinstance(drafter, Eagle3Drafter):
        _check_draft_vocabulary(drafter, files, spec)


def _check_draft_vocabulary(drafter: Eagle3Drafter, files: TensorFiles, spec: DrafterSpec) -> None:
    if "d2t" not in files:
        drafter.d2t.zero_()  # draft vocabulary = target vocabulary
    target_ids = torch.arange(spec.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t
    if not (bool((target_ids >= 0).all()) and bool((target_ids < spec.vocab_size).all())
            and bool((target_ids.diff() > 0).all())):
        raise ValueError(f"drafter: d2t in {spec.path} must map the draft ids to ascending target ids in "
                         f"[0, {spec.vocab_size})")
    t2d = drafter.t2d.clone()
    drafter.set_draft_vocabulary(target_ids)
    if "t2d" in files and not torch.equal(t2d, drafter.t2d):
        raise ValueError(f"drafter: t2d in {spec.path} does not mark exactly the {spec.draft_vocab_size} target ids "
                         f"that d2t maps to")
