"""The step loop: ``plan = schedule(); result = execute(plan); outputs = commit(plan, result)``."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

from eyas.config import EngineConfig
from eyas.core.request import Request, RequestStatus
from eyas.core.step import DoneRequest
from eyas.engine.output_processor import OutputProcessor
from eyas.engine.outputs import RequestOutput
from eyas.engine.parallel_sampling import ParentRequest, child_seeds
from eyas.engine.scheduler import Scheduler
from eyas.kv.manager import KVCacheManager
from eyas.model.tokenizer import Tokenizer
from eyas.runner.model_runner import ModelRunner
from eyas.sampling.grammar import GrammarCompiler
from eyas.sampling.params import SamplingParams

logger = logging.getLogger("eyas")


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, attention_backend: str | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(config, attention_backend)
        groups = self.runner.kv_cache_groups()
        block_size = config.cache.block_size
        bytes_per_block = sum(g.bytes_per_token for g in groups) * block_size
        num_blocks = config.cache.num_blocks or int(config.cache.kv_cache_gb * 2**30 // bytes_per_block)
        max_len = config.scheduler.max_model_len
        needed = -(-max_len // block_size) + 1  # + the reserved null block
        if num_blocks < needed:
            source = (f"num_kv_blocks: {num_blocks}" if config.cache.num_blocks else
                      f"kv_cache_gb: {config.cache.kv_cache_gb} GiB gives {num_blocks}")
            raise ValueError(
                f"{source} blocks of {block_size} tokens, "
                f"but one request of max_model_len={max_len} needs {needed} "
                f"({needed * bytes_per_block / 2**30:.3f} GiB); raise kv_cache_gb / num_kv_blocks or lower max_model_len")
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(groups, num_blocks, block_size, config.cache.enable_prefix_caching)
        spec = config.speculative
        device = config.device.type
        costs = (spec.row_cost(device, self.runner.measured_row_cost),
                 spec.step_cost(device, self.runner.proposer, self.runner.measured_draft_products)) if spec else ()
        self.scheduler = Scheduler(config.scheduler, self.kv, spec, *costs)
        self.outputs = OutputProcessor(tokenizer)
        # structured output: the grammar ends with the model's end-of-sequence tokens (else the tokenizer's)
        self.grammars = GrammarCompiler(tokenizer.backend.to_str, config.model.vocab_size,
                                        sorted(config.model.eos_token_ids or tokenizer.eos_token_ids))
        self.num_kv_blocks = num_blocks
        self._seed_rng = random.Random(config.seed)
        self.parents: dict[str, ParentRequest] = {}  # SamplingParams.n > 1: parent id -> its children
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> parent
        self.num_preemptions = 0  # since start
        logger.info("KV cache: %d blocks x %d tokens = %d token slots (%.3f GiB), %s, attention backend %s",
                    num_blocks - 1, block_size, (num_blocks - 1) * block_size,
                    num_blocks * bytes_per_block / 2**30, config.dtype, self.runner.backend.name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, stream: bool = True) -> None:
        """Validate at the edge: a bad request raises ValueError and changes nothing. ``stream=False``: ``step``
        returns the request's output only once it has ended (eyas.engine.output_processor)."""
        vocab, max_len = self.config.model.vocab_size, self.config.scheduler.max_model_len
        if request_id in self.scheduler.requests or request_id in self.parents:
            raise ValueError(f"request_id: '{request_id}' is already running")
        if not prompt_token_ids:
            raise ValueError("prompt: is empty; give at least one token")
        prompt_token_ids = params.kept_prompt(prompt_token_ids, max_len)
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name}: token ids {outside[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens does not fit max_model_len={max_len} "
                             f"(at most {max_len - 1} prompt tokens, leaving room for one output token)")
        grammar = self.grammars.compile(params.structured_output) if params.structured_output is not None else None
        if params.n == 1:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            self._submit(self._request(request_id, prompt_token_ids, params, seed, grammar), prompt, stream)
            return
        single = dataclasses.replace(params, n=1)
        seeds = child_seeds(params.seed, params.n, lambda: self._seed_rng.getrandbits(63))
        children = [self._request(ParentRequest.child_id(request_id, i), prompt_token_ids, single, seed, grammar)
                    for i, seed in enumerate(seeds)]
        parent = ParentRequest(request_id, children, prompt, stream)
        self.parents[request_id] = parent
        self._parent_of.update((c.request_id, parent) for c in children)
        self._submit(children[0], prompt, stream)
        if not self.config.cache.enable_prefix_caching:  # nothing to share: no reason to wait
            for child in parent.release():
                self._submit(child, prompt, stream)

    def _request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 grammar: str | None) -> Request:
        """One engine request; each has its own grammar position (n > 1 children too)."""
        request = Request(request_id, list(prompt_token_ids), len(prompt_token_ids), params, seed,
                          frozenset(self.config.model.eos_token_ids), self.config.scheduler.max_model_len)
        if grammar is not None:  # complete within the request's budget (eyas.sampling.grammar_budget)
            request.grammar = self.grammars.state(grammar, request.max_output_tokens)
        return request

    def _submit(self, request: Request, prompt: str | None, stream: bool) -> None:
        self.scheduler.add(request)
        self.outputs.add(request, prompt, stream)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (every child of an n > 1 request); its KV blocks are freed at once."""
        parent = self.parents.get(request_id)
        if parent is None:
            return self._abort_one(request_id)
        for child in parent.release():  # held children never ran: they finish aborted, empty
            self.outputs.add(child, parent.prompt, parent.stream)
            child.status, child.finish_time = RequestStatus.FINISHED_ABORTED, time.perf_counter()
            parent.merge(self.outputs.output(child))
        output = None
        for child in parent.children:
            child_output = self._abort_one(child.request_id)
            if child_output is not None:
                output = parent.merge(child_output)
        self._forget_parent(parent)
        return output or parent.output()

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        self.runner.request_done(DoneRequest(request_id, request.token_ids, request.num_prompt_tokens, None))
        return self.outputs.output(request)

    def _forget_parent(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        for child in parent.children:
            self._parent_of.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        result = self.runner.execute(plan)
        changed = self.scheduler.commit(plan, result)
        self.num_preemptions += len(plan.preempted)
        for request_id, (first, entries) in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(request_id, first, entries)
        outputs: dict[str, RequestOutput] = {}  # by request id: one (the latest) per n > 1 parent
        for request in changed:
            kept = self.outputs.update(request, result.logprobs.get(request.request_id))
            if kept is not None:
                self.scheduler.stop_string(request, kept)
            saved = self._done(request) if request.status.finished else None
            parent = self._parent_of.get(request.request_id)
            if parent is not None:
                for child in parent.release():  # child 0 has a token: the prompt's blocks are cached
                    self._submit(child, parent.prompt, parent.stream)
            if not self.outputs.wants_output(request):
                continue
            output = self.outputs.output(request)
            output.hidden_states_path = saved
            if parent is not None:
                output = parent.merge(output)
                if output.finished:
                    self._forget_parent(parent)
            outputs[output.request_id] = output
        return list(outputs.values())

    def _done(self, request: Request) -> str | None:
        """Tell the runner a request finished, with its blocks (whose contents last until the next forward) if
        it took part in speculation; returns what the proposer saved for it."""
        tables = self.scheduler.finished_tables.pop(request.request_id, None)
        return self.runner.request_done(DoneRequest(request.request_id, request.token_ids, request.num_prompt_tokens,
                                                    tables if request.params.speculate else None))

    def flush(self) -> None:
        """Wait for background work of finished requests (hidden-state files) and raise its errors."""
        self.runner.flush()

    def close(self) -> None:
        """Shut down: the proposer persists what outlives the engine (the suffix cache file). Call it last."""
        self.runner.close()

    def stats(self) -> dict:
        """Engine-wide speculation totals (acceptance length, per-position acceptance, forced drafts, ...) and
        the cost of structured output per step (``structured_output``)."""
        return {**self.scheduler.spec_stats.as_dict(), "structured_output": self.runner.grammar_timings.as_dict()}
