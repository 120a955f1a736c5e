"""Per-request sampling parameters (vLLM's names and defaults), validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.sampling.grammar import check_structured_output

MAX_LOGPROBS = 20


def _truncation(k) -> bool:
    """Whether ``k`` is a truncate_prompt_tokens that truncates: an integer >= 1, or -1."""
    return isinstance(k, int) and (k >= 1 or k == -1)


@dataclass
class SamplingParams:
    n: int = 1  # samples of the prompt, returned as outputs[0..n-1] (they share the prompt's cached blocks)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: as many as max_model_len leaves after the prompt (vLLM's meaning)
    min_tokens: int = 0  # no end-of-sequence, stop token or stop string ends an output before it
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list in __post_init__
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # the stop string that ended an output stays at the end of its text
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's; not with structured_output)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (vLLM's; -1: all that fit)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token, plus the sampled one (0: it only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (skips the prefix cache)
    skip_special_tokens: bool = True
    keep_special_token_ids: tuple[int, ...] = ()  # special tokens whose text stays all the same (a tool-call syntax's)
    detokenize: bool = True  # False: outputs carry token ids only (text ""), no per-step decoding
    speculate: bool = True  # False: this request opts out of speculative decoding
    presence_penalty: float = 0.0  # subtracted from the logits of tokens already in the output
    frequency_penalty: float = 0.0  # times each token's count in the output, subtracted
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (JSON's string keys are read as ints)
    # one of {"json": schema}, {"json_object": True}, {"regex": r}, {"choice": [...]}, {"grammar": lark or gbnf}
    # (eyas.sampling.grammar); the engine compiles it when the request arrives
    structured_output: dict | None = None

    def __post_init__(self) -> None:
        def bad(field: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={value!r} is invalid: must be {allowed}")

        if not (isinstance(self.n, int) and self.n >= 1):
            raise bad("n", self.n, "an integer >= 1")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed <= 2**63 - self.n):
            raise bad("seed", self.seed, "an integer in [-2**63, 2**63 - n] (child i of n samples uses seed + i)")
        if not self.temperature >= 0:
            raise bad("temperature", self.temperature, ">= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, ">= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1, or None (up to max_model_len)")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"None or in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, getattr(self, name), "in [-2, 2] (0 = off)")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", self.logit_bias, "a dict of token id -> bias") from None
            if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
                raise bad("logit_bias", self.logit_bias, "token ids >= 0 with biases in [-100, 100]")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "empty with detokenize=False (stop strings are matched in the text); "
                                         "use stop_token_ids")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, (list, tuple)) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
                raise bad("allowed_token_ids", ids, "a non-empty list of token ids >= 0")
            if self.structured_output is not None:
                raise bad("allowed_token_ids", ids, "None with structured_output (its grammar decides the tokens)")
            self.allowed_token_ids = list(ids)
        if self.truncate_prompt_tokens is not None and not _truncation(self.truncate_prompt_tokens):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens,
                      "None, an integer >= 1, or -1 (as many as max_model_len allows)")
        if any(t < 0 for t in self.keep_special_token_ids):
            raise bad("keep_special_token_ids", self.keep_special_token_ids, "a tuple of token ids >= 0")
        if self.structured_output is not None:
            check_structured_output(self.structured_output)

    @staticmethod
    def kept_length(length: int, truncate_prompt_tokens: int | None, max_model_len: int) -> int:
        """How many of a prompt's ``length`` tokens a request keeps: at most ``truncate_prompt_tokens`` (-1: max_model_len
        - 1, room for one output token). A value SamplingParams refuses keeps them all (the server sizes max_tokens
        with it before the params are built)."""
        if not _truncation(truncate_prompt_tokens):
            return length
        return min(length, max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens)

    def kept_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``kept_length`` tokens (left truncation, as vLLM's)."""
        n = len(prompt_token_ids)
        return prompt_token_ids[n - self.kept_length(n, self.truncate_prompt_tokens, max_model_len):]

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
