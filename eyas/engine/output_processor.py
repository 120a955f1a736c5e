"""Detokenizes outputs incrementally, applies stop strings, builds RequestOutput objects.

A request added with ``stream=False`` (``LLM.generate``: only its final output is read) and without stop strings
is detokenized once, when it ends, and gets no output before: at a batch of 512 on a tiny model (``python
benchmarks/bench_host.py``, 2 Zen 4 cores) that took the engine's host work per request and step from 36 to
14.5 us. The text is the same: the streaming detokenizer's deltas add up to the decoding of all the tokens at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.core.request import Request
from eyas.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from eyas.model.detokenizer import IncrementalDetokenizer
from eyas.model.tokenizer import Tokenizer
from eyas.sampling.params import SamplingParams


@dataclass
class _TextState:
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_detokenized: int = 0
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    stream: bool = True  # someone reads its outputs before it ends
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token; token 0 has None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _TextState] = {}

    def add(self, request: Request, prompt: str | None, stream: bool = True) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, request.params.skip_special_tokens,
                                       request.params.keep_special_token_ids)
        self.states[request.request_id] = _TextState(
            prompt, detok, stream=stream, logprobs=[] if request.params.logprobs is not None else None,
            prompt_logprobs=[None] if request.params.prompt_logprobs is not None else None)

    def add_prompt_logprobs(self, request_id: str, first: int, entries: list[dict[int, float]]) -> None:
        """Logprobs of prompt tokens ``first ..``; a prompt computed again (after preemption) adds nothing new."""
        state = self.states.get(request_id)
        if state is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(entries[len(state.prompt_logprobs) - first:])

    def wants_output(self, request: Request) -> bool:
        """Whether the request's output after this step is read: it ended, or it streams."""
        return request.status.finished or self.states[request.request_id].stream

    def update(self, request: Request, logprobs: list[dict[int, float]] | None) -> int | None:
        """Take the request's new tokens. Returns None, or, when a stop string ended it, how many output tokens it
        keeps: those up to the one that completed the stop string, as decoding a token a step meets it (a
        verification may have committed more)."""
        state = self.states[request.request_id]
        if state.logprobs is not None and logprobs:
            # one per committed token: a verification's tokens past an accepted end-of-sequence are not committed
            state.logprobs.extend(logprobs[:request.num_output_tokens - len(state.logprobs)])
        if not request.params.detokenize or not (state.stream or request.params.stop or request.status.finished):
            return None
        stops = request.params.stop
        if not stops:
            self._detokenize(state, request)
            return None
        # a token at a time: the stop string ends the output at the token completing it. None is looked for before
        # min_tokens outputs (as vLLM): the text of the first min_tokens only ends one that runs past them
        after = request.params.min_tokens
        new_tokens = request.output_token_ids[state.num_detokenized:]
        for token in new_tokens:
            old_len = len(state.text)
            state.text += state.detokenizer.add([token])
            state.num_detokenized += 1
            if state.num_detokenized > after and self._stopped(state, request.params, old_len):
                if state.logprobs is not None:
                    del state.logprobs[state.num_detokenized:]
                return state.num_detokenized
        if request.status.finished:
            old_len = len(state.text)
            state.text += state.detokenizer.flush()
            if state.num_detokenized > after and self._stopped(state, request.params, old_len):
                return state.num_detokenized
        return None

    @staticmethod
    def _stopped(state: _TextState, params: SamplingParams, old_len: int) -> bool:
        """Whether text added after ``old_len`` completes a stop string; if so the text is cut before it (after it
        with ``include_stop_str_in_output``)."""
        stops = params.stop
        tail_from = max(0, old_len - max(map(len, stops)) + 1)
        hits = [(state.text.find(s, tail_from), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        state.text = state.text[:index + len(stop) * params.include_stop_str_in_output]
        state.stop_reason = stop
        return True

    def _detokenize(self, state: _TextState, request: Request) -> None:
        """The text of the request's tokens not yet detokenized, and the held-back rest once it has ended."""
        new_tokens = request.output_token_ids[state.num_detokenized:]
        state.num_detokenized += len(new_tokens)
        state.text += state.detokenizer.add(new_tokens)
        if request.status.finished:
            state.text += state.detokenizer.flush()

    def output(self, request: Request) -> RequestOutput:
        state = self.states[request.request_id]
        finished = request.status.finished
        if finished:
            del self.states[request.request_id]
            if request.params.detokenize and state.num_detokenized < request.num_output_tokens:
                self._detokenize(state, request)  # ended without an update (an abort): its text still counts
        stop_reason = state.stop_reason
        if stop_reason is None and request.status.finish_reason == "stop" and request.output_token_ids:
            stop_reason = request.output_token_ids[-1]
        completion = CompletionOutput(0, state.text, list(request.output_token_ids), request.status.finish_reason,
                                      stop_reason if finished else None, state.logprobs, list(request.from_draft))
        metrics = RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time,
                                 request.num_output_tokens)
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids, [completion], finished,
                             metrics, request.num_cached_tokens, request.spec_stats.as_dict(),
                             prompt_logprobs=state.prompt_logprobs)
