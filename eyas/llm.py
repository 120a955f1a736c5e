"""The offline facade: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``chat``."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from typing import Iterator, Sequence

import torch

from eyas import kernels
from eyas.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, max_model_len_for
from eyas.engine.engine import Engine
from eyas.engine.outputs import RequestOutput
from eyas.model.resolve import gguf_file, resolve_model
from eyas.model.tokenizer import Tokenizer
from eyas.model.weight_policy import bf16_products_needed, resolve_matmul_precision, resolve_quantization
from eyas.sampling.defaults import sampling_defaults
from eyas.sampling.params import SamplingParams
from eyas.spec_decode.config import SpeculativeConfig
from eyas.spec_decode.speculator import speculators_redirect
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import constrain
from eyas.tools.render import render_chat

logger = logging.getLogger("eyas")
# text, token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[int] | dict
Conversation = list[dict]


def _setup_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s eyas: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class LLM:
    """An engine over one model. Argument names follow vLLM's where vLLM has one.

    ``model``: None or ``"smollm2"`` for the built-in SmolLM2-135M-Instruct, an HF folder, or a
    ``.gguf`` file. ``dtype``: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"bfloat16"``,
    ``"float16"`` or ``"float32"``. ``enforce_eager``: no CUDA graphs (on CUDA, the target's decode and
    verification steps and drafters' draft steps replay captured graphs; CPU runs are always eager).
    ``attention_backend``: None picks ``"cpu"`` on a CPU (its C kernel is built on first use, about a
    second, and cached; ``"sdpa"`` where no C compiler is found) and ``"sdpa"`` on CUDA; ``"flex"``
    is FlexAttention. ``quantization``: ``"auto"`` keeps a GGUF model's block formats on a CPU
    (``"gguf"``), gives an HF folder with ``dtype="auto"`` bfloat16 weights on a CPU with native bf16
    dot products (``"bf16"``), and otherwise the engine dtype; ``"gguf"``, ``"int8"`` (per-output-channel
    int8 made at load from any weights), ``"bf16"`` or None (the engine dtype) ask for one; the quantized
    formats keep activations in float32 between products. The choice is logged. ``matmul_precision``:
    ``"highest"`` (float32 products) or ``"medium"``: the quantized formats' products round activations and
    weights to bfloat16 and sum in float32 (AVX512-BF16 CPUs; about 1.6x faster past a few rows, outputs within
    bf16 rounding), as ``torch.set_float32_matmul_precision("medium")`` allows; ``"low"``: activations quantized
    to int8 per block of 32 and integer dot products on the weights' own integers (llama.cpp's arithmetic; the
    q/k/v products take each block as two int8 terms, nearly float32, and F16 / BF16 weights keep float32
    products), see docs/cpu-weights.md; ``"auto"`` (default): low
    for a GGUF of Q4_0 / Q4_1 / Q8_0 matrices on a CPU with VNNI (closer to float32 than llama.cpp and the fastest,
    as measured), else medium where the CPU's bf16 dot products outrun its float32 FMAs (as vLLM's CPU backend
    multiplies in bfloat16), else highest. Logged beside the weights.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                 device: str | None = None, max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, kv_cache_gb: float = 1.0, num_kv_blocks: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, seed: int = 0,
                 speculative_config: dict | None = None, attention_backend: str | None = None,
                 num_threads: int | None = None, enforce_eager: bool = False, quantization: str | None = "auto",
                 matmul_precision: str = "auto"):
        _setup_logging()
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads: {num_threads} must be >= 1")
            torch.set_num_threads(num_threads)
        dev = EngineConfig.resolve_device(device)
        with kernels.building() if dev.type == "cpu" else contextlib.nullcontext() as builds:  # beside the model
            path = resolve_model(model)
            redirect = speculators_redirect(path)
            if redirect is not None:  # a speculators drafter folder names its target (verifier) and k
                verifier, drafter_config = redirect
                try:
                    path = resolve_model(verifier)
                except ValueError as error:
                    raise ValueError(f"model: speculators drafter {model} names verifier {verifier!r}, which is "
                                     f"not a local model ({error})") from error
                speculative_config = speculative_config or drafter_config
            model_config = ModelConfig.from_folder(path, gguf_file(model if redirect is None else redirect[0]))
            if builds is not None and not bf16_products_needed(quantization, matmul_precision, model_config):
                builds.skip("bf16_products")
        max_len = max_model_len_for(model_config, max_model_len)
        quantization, why = resolve_quantization(quantization, model_config, dev, dtype)
        matmul_precision, products = resolve_matmul_precision(matmul_precision, quantization, model_config)
        logger.info("weights: %s (%s)%s", quantization or "engine dtype", why,
                    f"; matmul precision {matmul_precision}: {products}" if quantization is not None else "")
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size, kv_cache_gb, num_kv_blocks, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max(max_num_batched_tokens, 16), max_len),
            dtype=EngineConfig.resolve_dtype(dtype, dev),
            device=dev,
            seed=seed,
            enforce_eager=enforce_eager,
            quantization=quantization,
            matmul_precision=matmul_precision,
            speculative=SpeculativeConfig.from_dict(speculative_config) if speculative_config else None,
        )
        self.tokenizer = Tokenizer.from_folder(path)
        # the model's sampling defaults (generation_config.json, or the built-in model's card)
        self.sampling_defaults = sampling_defaults(model if redirect is None else redirect[0], path)
        self.engine = Engine(config, self.tokenizer, attention_backend)
        self._ids = itertools.count()

    def close(self) -> None:
        """Shut down the engine: a suffix cache file (``suffix_decoding_cache_file``) is written now. Nothing
        runs after it. Without a call it is written at interpreter exit. ``with LLM(...) as llm:`` closes too."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Engine-wide speculation metrics: drafted, accepted, mean acceptance length, per position."""
        return self.engine.stats()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no params: the model's sampling defaults (vLLM's name)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (text, token-id lists, or vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``) to
        completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(self._add_all(encoded, self._params_list(sampling_params, len(encoded)), stream=False),
                         use_tqdm)

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """A prompt's token ids and text (None when given as ids)."""
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise ValueError(f"prompt: a dict must hold 'prompt' (text) or 'prompt_token_ids' alone; got keys "
                                 f"{sorted(prompt)}")
        return (self.tokenizer.encode(prompt), prompt) if isinstance(prompt, str) else (list(prompt), None)

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        params = params if params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"sampling_params: {len(params)} given for {n} prompts; give one or one each")
        return list(params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True, *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render conversations with the model's chat template, then generate.

        ``tools``, ``tool_choice``, ``parallel_tool_calls``: OpenAI's shapes (docs/tools.md). Each output's
        ``tool_calls`` then lists the reply's calls (arguments valid against their schema by construction);
        its ``text`` is the whole reply, calls included. ``continue_final_message``: the reply continues the
        final assistant message (give ``add_generation_prompt=False``). ``chat_template_kwargs``: more variables
        for the chat template, as vLLM's (``{"enable_thinking": False}`` for Qwen3's).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        request = ToolRequest.from_openai(tools, tool_choice, parallel_tool_calls, self.tokenizer)
        texts = [render_chat(self.tokenizer, c, request, add_generation_prompt, continue_final_message,
                             chat_template_kwargs)
                 for c in conversations]
        # the template already carries any BOS token, so encode without special tokens (as HF does)
        prompts = [(self.tokenizer.encode(t, add_special_tokens=False), t) for t in texts]
        params = [constrain(p, request) for p in self._params_list(sampling_params, len(prompts))]
        outputs = self._run(self._add_all(prompts, params, stream=False), use_tqdm)
        if request is not None and request.callable:
            for completion in (c for out in outputs for c in out.outputs):
                completion.tool_calls = parse_reply(completion.text, request.syntax).calls
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (cumulative text and tokens)."""
        encoded = (self.tokenizer.encode(prompt), prompt) if isinstance(prompt, str) else (list(prompt), None)
        (request_id,) = self._add_all([encoded], [sampling_params or self.get_default_sampling_params()], stream=True)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.finished:
                            self.engine.flush()  # a file named by the output exists once it is yielded
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _add_all(self, prompts: list[tuple[list[int], str | None]], params: list[SamplingParams],
                 stream: bool) -> list[str]:
        """Add every prompt or none; ``stream=False``: only their final outputs are read (``Engine.add_request``)."""
        ids: list[str] = []
        try:
            for (token_ids, text), p in zip(prompts, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, token_ids, p, text, stream)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: the engine keeps serving everyone else
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        num_generated = 0
        while len(finished) < len(ids):
            for out in self.engine.step():  # only finished outputs: the requests do not stream
                if out.finished and out.request_id in wanted:
                    num_generated += sum(len(c.token_ids) for c in out.outputs)
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"{num_generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
        if bar is not None:
            bar.close()
        self.engine.flush()  # files named by the outputs exist when generate returns
        return [finished[i] for i in ids]
