"""What every route shares: the engine loop, admission checks, submitting prompts, and collecting their
outputs whole or as SSE chunks. Routes live in their own modules and call one ``Service``.

A handler raises ``ApiError`` for an answer other than 200; ``app.py`` turns it into OpenAI error JSON.
A client that goes away aborts its requests; nothing it left behind is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass

from fastapi import Request

from eyas.engine.outputs import RequestOutput
from eyas.llm import LLM
from eyas.sampling.params import SamplingParams
from eyas.server.engine_loop import EngineLoop
from eyas.server.metrics import ServerMetrics
from eyas.server.responses import Formatter
from eyas.server.tool_stream import ReplyDeltas

MAX_N = 128  # samples per prompt a request may ask for


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int | None = None  # 503 past this many waiting requests
    per_request_spec_metrics: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def param_of(message: str) -> str | None:
    """The field a ValueError names: ``SamplingParams.top_p=...``, ``prompt: ...``, ``structured_output.json: ...``
    or ``messages[2].tool_call_id: ...`` (the request's field: ``messages``)."""
    match = re.match(r"(?:SamplingParams\.)?([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)*\s*[:=]", message)
    return match.group(1) if match else None


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def _holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else stop or []
    return max((len(s) for s in stops), default=1) - 1


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Service:
    def __init__(self, llm: LLM, settings: ServerSettings):
        self.llm, self.settings = llm, settings
        self.tokenizer = llm.get_tokenizer()
        self.engine = llm.engine
        self.max_model_len = self.engine.config.scheduler.max_model_len
        self.metrics = ServerMetrics(settings.model_name)
        self.defaults = llm.sampling_defaults  # the model's, for the fields a request leaves out
        self.loop: EngineLoop | None = None  # started by the app's lifespan

    def start(self) -> None:
        self.loop = EngineLoop(self.engine, self.metrics.observe_step)

    def stop(self) -> None:
        self.loop.shutdown()  # in-flight requests are aborted, their blocks freed

    def formatter(self, request_id: str, chat: bool) -> Formatter:
        return Formatter(self.tokenizer, self.settings.model_name, request_id, chat=chat,
                         spec_metrics=self.settings.per_request_spec_metrics)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.settings.model_name}'",
                           "model", "model_not_found")

    def check(self, body, unsupported: dict[str, str]) -> None:
        """The model, ``n``, fields eyas refuses by name, and admission (503 past ``max_waiting``)."""
        self.check_model(body.model)
        if not 1 <= body.n <= MAX_N:
            raise ApiError(400, f"n: {body.n} must be in [1, {MAX_N}]", "n")
        for field, message in unsupported.items():
            if getattr(body, field) is not None:
                raise ApiError(400, f"{field}: {message}", field)
        max_waiting = self.settings.max_waiting
        if max_waiting is not None and self.loop.snapshot.num_waiting + self.loop.pending() >= max_waiting:
            raise ApiError(503, f"server busy: {max_waiting} requests are already waiting; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"})

    def kept(self, prompt_len: int, body) -> int:
        """The prompt tokens a request keeps after vLLM's ``truncate_prompt_tokens`` (the engine truncates)."""
        return SamplingParams.kept_length(prompt_len, body.truncate_prompt_tokens, self.max_model_len)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        room = self.max_model_len - prompt_len
        if requested is None:
            return max(room, 1)
        if requested < 1:
            raise ApiError(400, f"{param}: {requested} must be >= 1", param)
        if prompt_len < self.max_model_len and requested > room:
            raise ApiError(400, f"{param}: the context is {self.max_model_len} tokens and the prompt has {prompt_len}, "
                                f"so at most {room} can be generated, not {requested}", param)
        return requested

    async def submit_all(self, request_id: str, prompts: list[tuple[list[int], str | None]], params_of) -> list:
        """Every prompt's params first (a bad one refuses the request whole), then one engine request each."""
        try:
            params = [params_of(len(ids)) for ids, _ in prompts]
        except ValueError as error:
            raise ApiError(400, str(error), param_of(str(error))) from None
        queues = []
        try:
            for i, ((ids, text), p) in enumerate(zip(prompts, params)):
                queues.append(await self.loop.submit(f"{request_id}-{i}", ids, p, text))
        except ValueError as error:
            for i in range(len(queues)):
                self.loop.abort(f"{request_id}-{i}")
            raise ApiError(400, str(error), param_of(str(error))) from None
        return queues

    async def final_outputs(self, request: Request, request_id: str, queues: list) -> list[RequestOutput]:
        async def last(q) -> RequestOutput:
            while True:
                out = await q.get()
                if out.finished:
                    return out

        gather = asyncio.ensure_future(asyncio.gather(*(last(q) for q in queues)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not gather.done():  # the client left: abort, nothing to answer
            gather.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gather  # retrieved, so asyncio logs nothing about it
            for i in range(len(queues)):
                self.loop.abort(f"{request_id}-{i}")
            raise ApiError(400, "client disconnected")
        gone.cancel()
        return gather.result()

    async def outputs(self, request_id: str, queues: list):
        """(prompt index, output) as every prompt's output changes, until all are finished; a consumer that
        stops early (a client that went away, a server shutting down) aborts what is left."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, q) -> None:
            while True:
                out = await q.get()
                await merged.put((i, out))
                if out.finished:
                    return

        pumps = [asyncio.ensure_future(pump(i, q)) for i, q in enumerate(queues)]
        finished: set[int] = set()
        try:
            while len(finished) < len(queues):
                i, out = await merged.get()
                if out.finished:
                    finished.add(i)
                yield i, out
        finally:
            for p in pumps:
                p.cancel()
            for i in range(len(queues)):
                if i not in finished:
                    self.loop.abort(f"{request_id}-{i}")

    async def stream(self, request_id: str, queues: list, fmt: Formatter, body, top: int,
                     echo: list[str] | None = None, tools=None):
        """SSE chunks of every choice as its text grows. ``holdback``: characters kept back until the next
        output or the end, so a stop string that is still forming is never sent (the longest stop, less one).
        Chat choices send deltas (``ReplyDeltas``: content, and tool calls when ``tools`` may be called). ``echo``:
        a completion choice's first chunk starts with its prompt, and its logprobs with the prompt's."""
        n, holdback = body.n, _holdback(body.stop)
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        ended: set[int] = set()  # choice indices whose finish_reason was sent
        echoed: set[int] = set()  # completions: choice indices whose echoed prompt was sent (with their first text)
        offsets: dict[int, int] = {}  # completions: choice index -> text offset of its next token (as whole answers)
        deltas: dict[int, ReplyDeltas] = {}
        finals: dict[int, RequestOutput] = {}
        if fmt.chat:
            for index in range(len(queues) * n):
                deltas[index] = ReplyDeltas(tools)
                yield sse(fmt.chunk(index, {"role": "assistant", "content": ""}, None))
        async for i, out in self.outputs(request_id, queues):
            for completion in out.outputs:
                index = i * n + completion.index
                if index in ended:
                    continue
                chars, tokens = sent.get(index, (0, 0))
                done = completion.finish_reason is not None
                if not completion.token_ids and not done:  # not started (a child of n > 1 held back)
                    continue
                visible = len(completion.text) if done else max(chars, len(completion.text) - holdback)
                if fmt.chat:
                    piece = deltas[index].update(completion.text[:visible], done)
                    reason = deltas[index].finish_reason(completion.finish_reason)
                    if not piece and not done:
                        continue
                else:
                    piece, reason = completion.text[chars:visible], completion.finish_reason
                    if visible == chars and not done and (echo is None or index in echoed):
                        continue
                prefix = echo[i] if echo else ""
                logprobs = fmt.logprobs(completion, tokens, len(completion.token_ids),
                                        offsets.get(index, len(prefix)), top)
                if logprobs is not None and logprobs.get("tokens"):
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                if echo and index not in echoed:  # the prompt goes first, with its logprobs, as vLLM streams it
                    piece = prefix + piece
                    if logprobs is not None and out.prompt_logprobs is not None:
                        logprobs = fmt.with_prompt(out, logprobs, top)
                    echoed.add(index)
                sources = (completion, tokens) if body.return_token_sources else None
                yield sse(fmt.chunk(index, piece, reason, logprobs, sources=sources))
                sent[index] = (visible, len(completion.token_ids))
                if done:
                    ended.add(index)
            if out.finished:
                finals[i] = out
        if body.include_usage:
            yield sse(fmt.usage_chunk([finals[i] for i in range(len(queues))]))
        yield sse("[DONE]")
