"""``speculative_config``: which drafter, how many draft tokens, how drafts are verified."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from eyas.spec.adaptive import FREE_ROWS, RowCost

MAX_SPECULATIVE_TOKENS = 16
# options that belong to one method or a few; a proposer lists the ones it reads in ``config_fields``
METHOD_FIELDS = frozenset({"prompt_lookup_min", "prompt_lookup_max", "model", "draft_num_layers", "aux_layer_ids",
                           "output_dir", "include_output_tokens", "suffix_decoding_max_tree_depth",
                           "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                           "suffix_decoding_min_token_prob", "suffix_decoding_cache_file",
                           "enable_suffix_decoding", "parallel_drafting"})
SUFFIX_FIELDS = frozenset(name for name in METHOD_FIELDS if name.startswith("suffix_decoding_"))
VERIFICATION_MODES = ("rejection", "shared_noise")
# A CPU forward of n rows, in one-row forwards, by the target's weight format and matmul precision: (rows, cost)
# points measured by benchmarks/bench_row_cost.py (one request, n new rows on a cached 192-token prefix,
# SmolLM2-135M, AMD Zen 4, 2 threads; the median of three runs, 2026-11-27). Float32 weights are read from memory
# once whatever the rows, so a row adds little (16 rows: 2.07x a one-row forward); eyas's bf16, int8 and GGUF
# kernels read fewer bytes and decode every weight in registers, multiplying it into each row, so rows cost their
# arithmetic (16 rows at "highest", float32 products: 2.47x, 3.63x, 3.43x). Up to 4 rows share one register tile;
# past it the first 4 rows' pass keeps the decoded tile in memory for the others, the step between 4 and 5 rows
# (before that pass kept it, when the tile was decoded into memory first: GGUF 2.07 at 5 rows, 4.11 at 16). "medium"
# (bfloat16 products, half the instructions) makes rows cheaper. (Intel Sapphire Rapids, GGUF, float32 products,
# the older kernel: 1.09, 1.22, 1.30 for 2-4 rows, 1.89 for 5, 3.24 for 16.)
_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
CPU_ROW_COSTS = {key: RowCost(tuple(zip(_ROWS, costs))) for key, costs in {  # (quantization, matmul precision)
    (None, "highest"): (1.00, 1.01, 1.04, 1.07, 1.12, 1.20, 1.36, 1.52, 1.71, 2.07),
    ("bf16", "highest"): (1.00, 1.05, 1.05, 1.19, 1.54, 1.58, 1.70, 1.91, 2.23, 2.47),
    ("int8", "highest"): (1.00, 1.06, 1.22, 1.29, 1.79, 1.85, 2.22, 2.59, 2.91, 3.63),
    ("gguf", "highest"): (1.00, 1.10, 1.22, 1.38, 1.76, 1.87, 2.15, 2.49, 2.76, 3.43),
    ("bf16", "medium"): (1.00, 1.06, 1.07, 1.12, 1.32, 1.44, 1.61, 1.68, 1.82, 2.06),
    ("int8", "medium"): (1.00, 1.09, 1.15, 1.24, 1.62, 1.68, 1.86, 2.17, 2.30, 2.80),
    ("gguf", "medium"): (1.00, 1.06, 1.13, 1.25, 1.38, 1.47, 1.54, 1.74, 1.89, 2.23)}.items()}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative settings.

    ``verification``: ``"rejection"`` (Leviathan et al.; drafts without probabilities count
    as one-hot; output follows the target distribution) or ``"shared_noise"`` (target and drafter
    share the seeded Gumbel noise; output is token-identical to the same seeded request without
    speculation). Greedy requests take an exact-match fast path under both. Rejection is the
    default: it is the maximal coupling of draft and target (a sampled draft is accepted with
    probability 1 - TV(p, q), the most any coupling allows; a one-hot draft x with p(x) under
    both modes). At temperature 0.7 on real prompts (benchmarks/bench_verification.py, 16 chat +
    16 copy prompts, 96 tokens) it accepted more n-gram drafts (0.468 vs 0.412) and about as many
    self-drafts with 16 layers (0.036 vs 0.038).
    """

    method: str
    num_speculative_tokens: int
    verification: str = "rejection"
    # shrink drafts when they keep being rejected, and verify in a batch only the drafts
    # worth their rows (spec/adaptive.py); False = always verify every draft
    adaptive_draft_length: bool = True
    # what one more row of a forward costs, as a fraction of a one-row forward (spec/adaptive.py): a forward of
    # n rows costs 1 + c * n, and drafts are verified only while their expected tokens cover their rows.
    # None = the weight format's measured curve on a CPU (CPU_ROW_COSTS), and 0 on CUDA, where a few more rows
    # cost next to nothing (every draft is verified)
    draft_row_cost: float | None = None
    # what drafting costs in a step in which some request drafts, as a fraction of a one-row forward, for a
    # proposer that leaves out the requests the scheduler expects to verify no drafts of (spec/adaptive.py):
    # drafts are verified only where they pay for it too. None = the proposer's figure for the device
    # (``Proposer.step_cost``: 0.15 for hidden-state drafters on a CPU; 0 on CUDA and for n-gram and suffix)
    draft_step_cost: float | None = None
    prompt_lookup_min: int = 2  # n-gram
    prompt_lookup_max: int = 4
    model: str | None = None  # draft model (HF folder or .gguf)
    draft_num_layers: int | None = None  # self-speculation with the target's first layers
    aux_layer_ids: tuple[int, ...] | None = None  # target layers whose input stream is read (vLLM convention)
    output_dir: str | None = None  # extract_hidden_states: where {request_id}.safetensors files go
    include_output_tokens: bool = False  # extract_hidden_states: dump generated tokens too
    # suffix decoding (eyas.spec.suffix; vLLM's names and defaults): depth of the suffix trees (match + draft),
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000  # outputs kept in the global tree (FIFO); 0 = no global tree
    suffix_decoding_max_spec_factor: float = 1.0  # at most factor x match length drafted
    suffix_decoding_min_token_prob: float = 0.1  # stop drafting where the continuation's probability falls below
    suffix_decoding_cache_file: str | None = None  # global tree saved here at shutdown, loaded at start
    # a model drafter's method with suffix decoding in front of it (eyas.spec.suffix_hybrid, ArcticInference's
    # option): a request whose suffix draft scores at least k takes it, the others the drafter's
    enable_suffix_decoding: bool = False
    # eagle3: the drafter is a parallel one (P-EAGLE, vLLM's name): drafts 2..k in one forward of mask rows
    # (eyas.spec.speculator); without "model" the shipped parallel drafter
    parallel_drafting: bool = False

    @cached_property
    def suffix_config(self) -> "SpeculativeConfig | None":
        """The suffix-decoding part of a config with ``enable_suffix_decoding`` (None without): method "suffix",
        this config's suffix options, and k = the longest draft those options allow."""
        if not self.enable_suffix_decoding:
            return None
        return SpeculativeConfig.from_dict({"method": "suffix", **{name: getattr(self, name) for name in SUFFIX_FIELDS}})

    @cached_property
    def max_drafts(self) -> int:
        """The most drafts a request may verify in a step (every request's lookahead slots): k, or with
        ``enable_suffix_decoding`` the longer of k and suffix decoding's longest draft (12 by default)."""
        suffix = self.suffix_config
        return max(self.num_speculative_tokens, suffix.num_speculative_tokens if suffix else 0)

    def row_cost(self, device_type: str, quantization: str | None, matmul_precision: str = "highest") -> RowCost:
        """``draft_row_cost``'s line, else the cost for the device and the target's weight format and products
        (``EngineConfig.quantization``, ``EngineConfig.matmul_precision``)."""
        if self.draft_row_cost is not None:
            return RowCost.linear(self.draft_row_cost)
        return CPU_ROW_COSTS[(quantization, matmul_precision)] if device_type == "cpu" else FREE_ROWS

    def step_cost(self, device_type: str, proposer) -> float:
        return self.draft_step_cost if self.draft_step_cost is not None else proposer.step_cost(device_type)

    @classmethod
    def from_dict(cls, config: dict | "SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config: expected a dict, got {type(config).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        if "method" not in config:
            raise ValueError("speculative_config.method: missing (e.g. 'ngram' or 'draft_model')")
        if "num_speculative_tokens" not in config:
            from eyas.spec.proposer import proposer_class

            k = proposer_class(config["method"]).default_num_speculative_tokens(config)
            if k is None:
                raise ValueError("speculative_config.num_speculative_tokens: missing (e.g. 4)")
            config = {**config, "num_speculative_tokens": k}
        return cls(**config)

    def __post_init__(self):
        from eyas.spec.proposer import proposer_class

        proposer = proposer_class(self.method)  # raises with the list of methods
        for name in METHOD_FIELDS - proposer.config_fields:
            if getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(f"speculative_config.{name}: not used by method '{self.method}' "
                                 f"(it reads {', '.join(sorted(proposer.config_fields)) or 'none of the method options'})")
        if "enable_suffix_decoding" in proposer.config_fields and not self.enable_suffix_decoding:
            for name in SUFFIX_FIELDS:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ValueError(f"speculative_config.{name}: method '{self.method}' reads it only with "
                                     f"enable_suffix_decoding: true")
        if not isinstance(self.enable_suffix_decoding, bool):
            raise ValueError(f"speculative_config.enable_suffix_decoding: {self.enable_suffix_decoding!r} must be "
                             f"true or false")
        if not isinstance(self.parallel_drafting, bool):
            raise ValueError(f"speculative_config.parallel_drafting: {self.parallel_drafting!r} must be true or false")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if isinstance(ids, str) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"speculative_config.aux_layer_ids: {ids!r} must be a list of layer ids (ints)")
            if len(set(ids)) != len(ids):
                raise ValueError(f"speculative_config.aux_layer_ids: {list(ids)} has repeated ids")
            object.__setattr__(self, "aux_layer_ids", tuple(ids))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: {k!r} must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"speculative_config.verification: '{self.verification}' is not one of "
                             f"{', '.join(VERIFICATION_MODES)}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min/max: need 1 <= min <= max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.draft_row_cost is not None and not (isinstance(self.draft_row_cost, (int, float))
                                                    and 0 <= self.draft_row_cost < float("inf")):
            raise ValueError(f"speculative_config.draft_row_cost: {self.draft_row_cost!r} must be a number >= 0 "
                             f"(0 = verify every draft)")
        if self.draft_step_cost is not None and not (isinstance(self.draft_step_cost, (int, float))
                                                     and 0 <= self.draft_step_cost < float("inf")):
            raise ValueError(f"speculative_config.draft_step_cost: {self.draft_step_cost!r} must be a number >= 0 "
                             f"(0 = drafting costs nothing)")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative_config.draft_num_layers: {self.draft_num_layers} must be >= 1")
        proposer.validate_config(self)
        if self.enable_suffix_decoding:
            self.suffix_config  # noqa: B018 (validates the suffix options now)


_DEFAULTS = {f.name: f.default for f in fields(SpeculativeConfig)}
