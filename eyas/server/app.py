"""The OpenAI-compatible HTTP API over one engine loop (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
SSE ending with ``data: [DONE]``), ``GET /health``, ``GET /metrics``, ``GET /`` (the playground)
and FastAPI's ``/openapi.json``. Errors are OpenAI error JSON: 400 for a bad parameter (naming it),
401 for a missing or wrong key on ``/v1`` routes, 404 for an unknown model or route, 503 with
``Retry-After`` past ``max_waiting``. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.engine.outputs import RequestOutput
from eyas.llm import LLM
from eyas.server.engine_loop import EngineLoop
from eyas.server.metrics import ServerMetrics
from eyas.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from eyas.server.responses import Formatter

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


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                503: "server_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    """The field a ValueError names: ``SamplingParams.top_p=...``, ``prompt: ...`` or ``structured_output.json: ...``."""
    match = re.match(r"(?:SamplingParams\.)?([a-z_]+)(?:\.[a-z_]+)?\s*[:=]", message)
    return match.group(1) if match else None


def _holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else stop or []
    return max((len(s) for s in stops), default=1) - 1


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(llm: LLM, settings: ServerSettings) -> FastAPI:
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    max_model_len = engine.config.scheduler.max_model_len
    metrics = ServerMetrics(settings.model_name)
    defaults = llm.sampling_defaults  # the model's, for the fields a request leaves out
    state: dict[str, EngineLoop] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["loop"] = EngineLoop(engine, metrics.observe_step)
        yield
        state["loop"].shutdown()  # in-flight requests are aborted, their blocks freed

    app = FastAPI(title="eyas", description="OpenAI-compatible API of the eyas inference engine", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError):
        return _error(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the request's field; the message says where inside it
        return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if error.status_code == 404 else str(error.detail)
        return _error(error.status_code, message, code="not_found" if error.status_code == 404 else None)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {settings.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        return await call_next(request)

    def check(body) -> None:
        if body.model is not None and body.model != settings.model_name:
            raise ApiError(404, f"model '{body.model}' does not exist; this server serves '{settings.model_name}'",
                           "model", "model_not_found")
        if not 1 <= body.n <= MAX_N:
            raise ApiError(400, f"n: {body.n} must be in [1, {MAX_N}]", "n")
        for field, message in UNSUPPORTED[type(body)].items():
            if getattr(body, field) is not None:
                raise ApiError(400, f"{field}: {message}", field)
        loop = state["loop"]
        if settings.max_waiting is not None and loop.snapshot.num_waiting + loop.pending() >= settings.max_waiting:
            raise ApiError(503, f"server busy: {settings.max_waiting} requests are already waiting; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"})

    def resolve_max_tokens(requested: int | None, prompt_len: int, param: str) -> int:
        room = max_model_len - prompt_len
        if requested is None:
            return max(room, 1)
        if requested < 1:
            raise ApiError(400, f"{param}: {requested} must be >= 1", param)
        if prompt_len < max_model_len and requested > room:
            raise ApiError(400, f"{param}: the context is {max_model_len} tokens and the prompt has {prompt_len}, "
                                f"so at most {room} can be generated, not {requested}", param)
        return requested

    async def submit_all(request_id: str, prompts: list[tuple[list[int], str | None]], params_of) -> list:
        """Every prompt's params first (a bad one refuses the request whole), then one engine request each."""
        try:
            params = [params_of(len(ids)) for ids, _ in prompts]
        except ValueError as error:
            raise ApiError(400, str(error), _param_of(str(error))) from None
        loop, queues = state["loop"], []
        try:
            for i, ((ids, text), p) in enumerate(zip(prompts, params)):
                queues.append(await loop.submit(f"{request_id}-{i}", ids, p, text))
        except ValueError as error:
            for i in range(len(queues)):
                loop.abort(f"{request_id}-{i}")
            raise ApiError(400, str(error), _param_of(str(error))) from None
        return queues

    async def final_outputs(request: Request, request_id: str, queues: list) -> list[RequestOutput]:
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
            for i in range(len(queues)):
                state["loop"].abort(f"{request_id}-{i}")
            raise ApiError(400, "client disconnected")
        gone.cancel()
        return gather.result()

    async def stream(request_id: str, queues: list, fmt: Formatter, body, top: int, echo: list[str] | None = None):
        """SSE chunks of every choice as its text grows. ``holdback``: characters kept back until the next
        output or the end, so a stop string that is still forming is never sent (the longest stop, less one)."""
        n, holdback = body.n, _holdback(body.stop)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, q) -> None:
            while True:
                out = await q.get()
                await merged.put((i, out))
                if out.finished:
                    return

        pumps = [asyncio.ensure_future(pump(i, q)) for i, q in enumerate(queues)]
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        ended: set[int] = set()  # choice indices whose finish_reason was sent
        finals: dict[int, RequestOutput] = {}
        try:
            if fmt.chat:
                for index in range(len(queues) * n):
                    yield _sse(fmt.chunk(index, "", None, first=True))
            elif echo:
                for i, text in enumerate(echo):
                    for j in range(n):
                        yield _sse(fmt.chunk(i * n + j, text, None))
            while len(finals) < len(queues):
                i, out = await merged.get()
                for completion in out.outputs:
                    index = i * n + completion.index
                    if index in ended:
                        continue
                    chars, tokens = sent.get(index, (0, 0))
                    done = completion.finish_reason is not None
                    visible = len(completion.text) if done else max(chars, len(completion.text) - holdback)
                    if visible == chars and not done:
                        continue
                    logprobs = fmt.logprobs(completion, tokens, len(completion.token_ids), chars, top)
                    sources = (completion, tokens) if body.return_token_sources else None
                    yield _sse(fmt.chunk(index, completion.text[chars:visible], completion.finish_reason, logprobs,
                                         sources=sources))
                    sent[index] = (visible, len(completion.token_ids))
                    if done:
                        ended.add(index)
                if out.finished:
                    finals[i] = out
            if body.include_usage:
                yield _sse(fmt.usage_chunk([finals[i] for i in range(len(queues))]))
            yield _sse("[DONE]")
        finally:  # a client that went away (or a server shutting down) aborts what is left
            for p in pumps:
                p.cancel()
            for i in range(len(queues)):
                if i not in finals:
                    state["loop"].abort(f"{request_id}-{i}")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "eyas", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        prompts = []
        for p in body.prompts():
            prompts.append((tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None))
        if not prompts:
            raise ApiError(400, "prompt: is empty; give a string, a list of strings or token ids", "prompt")
        top = body.logprobs or 0
        request_id = f"cmpl-{uuid.uuid4().hex}"
        queues = await submit_all(request_id, prompts, lambda length: body.sampling_params(
            defaults, resolve_max_tokens(body.max_tokens, length, "max_tokens"), body.logprobs))
        fmt = Formatter(tokenizer, settings.model_name, request_id, chat=False,
                        spec_metrics=settings.per_request_spec_metrics)
        echo = [text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
                for ids, text in prompts] if body.echo else None
        if body.stream:
            return StreamingResponse(stream(request_id, queues, fmt, body, top, echo),
                                     media_type="text/event-stream")
        return fmt.response(await final_outputs(request, request_id, queues), body.n, top, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check(body)
        if tokenizer.chat_template is None:
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        try:
            text = tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=body.add_generation_prompt)
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None
        except Exception as error:  # the template itself refused the conversation (e.g. roles out of order)
            raise ApiError(400, f"messages: the chat template refused them ({error})", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs or 0
        requested, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                            is not None else (body.max_tokens, "max_tokens"))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        queues = await submit_all(request_id, [(ids, text)], lambda length: body.sampling_params(
            defaults, resolve_max_tokens(requested, length, param), top if body.logprobs else None))
        fmt = Formatter(tokenizer, settings.model_name, request_id, chat=True,
                        spec_metrics=settings.per_request_spec_metrics)
        if body.stream:
            return StreamingResponse(stream(request_id, queues, fmt, body, top),
                                     media_type="text/event-stream")
        return fmt.response(await final_outputs(request, request_id, queues), body.n, top)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(state["loop"].snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("eyas.server").joinpath("playground.html").read_text(encoding="utf-8"))

    return app
