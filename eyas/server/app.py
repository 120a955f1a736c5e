"""The OpenAI-compatible HTTP API over one engine loop (FastAPI).

Routes: ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(with tools; ``routes_openai``), ``POST /v1/responses`` (``routes_responses``), ``POST /tokenize`` and
``/detokenize`` (``routes_tokenize``), ``GET /health``, ``GET /metrics``, ``GET /`` (the playground) and
FastAPI's ``/openapi.json``. Streams are SSE ending with ``data: [DONE]`` (the Responses API: its events).
Errors are OpenAI error JSON: 400 for a bad parameter (naming it), 401 for a missing or wrong key on ``/v1``
routes, 404 for an unknown model or route, 503 with ``Retry-After`` past ``max_waiting``. A client that
goes away aborts its requests.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.llm import LLM
from eyas.server import routes_openai, routes_responses, routes_tokenize
from eyas.server.service import ApiError, ServerSettings, Service

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                503: "server_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(llm: LLM, settings: ServerSettings) -> FastAPI:
    service = Service(llm, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        service.stop()

    app = FastAPI(title="eyas", description="OpenAI-compatible API of the eyas inference engine", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError):
        return _error(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", character offset): no field to name
            return _error(400, f"body: not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})")
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

    for module in (routes_openai, routes_responses, routes_tokenize):
        app.include_router(module.router(service))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(service.metrics.render(service.loop.snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(resources.files("eyas.server").joinpath("playground.html").read_text(encoding="utf-8"))

    return app
