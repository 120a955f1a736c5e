"""``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A chat request may carry ``tools`` (``eyas.tools``): its prompt is rendered with them, its reply is
constrained by their grammar, and the reply's calls come back as ``message.tool_calls`` (or as stream
deltas) with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from eyas.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from eyas.server.service import ApiError, Service, param_of
from eyas.tools import ToolRequest
from eyas.tools.grammar import constrain
from eyas.tools.render import render_chat


def router(service: Service) -> APIRouter:
    routes = APIRouter()
    tokenizer = service.tokenizer

    def model_card() -> dict:
        return {"id": service.settings.model_name, "object": "model", "created": 0, "owned_by": "eyas",
                "max_model_len": service.max_model_len}

    @routes.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @routes.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != service.settings.model_name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{service.settings.model_name}'",
                           "model", "model_not_found")
        return model_card()

    @routes.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.check(body, UNSUPPORTED[CompletionRequest])
        prompts = []
        for p in body.prompts():
            prompts.append((tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None))
        if not prompts:
            raise ApiError(400, "prompt: is empty; give a string, a list of strings or token ids", "prompt")
        top = body.logprobs or 0
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_logprobs = body.logprobs if body.echo else None  # the echoed prompt's logprobs
        queues = await service.submit_all(request_id, prompts, lambda length: body.sampling_params(
            service.defaults, service.resolve_max_tokens(body.max_tokens, service.kept(length, body), "max_tokens"),
            body.logprobs,
            prompt_logprobs))
        fmt = service.formatter(request_id, chat=False)
        echo = [text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
                for ids, text in prompts] if body.echo else None
        if body.stream:
            return StreamingResponse(service.stream(request_id, queues, fmt, body, top, echo),
                                     media_type="text/event-stream")
        return fmt.response(await service.final_outputs(request, request_id, queues), body.n, top, echo)

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service.check(body, UNSUPPORTED[ChatCompletionRequest])
        if tokenizer.chat_template is None:
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        try:
            tools = ToolRequest.from_openai(body.tools, body.tool_choice, body.parallel_tool_calls,
                                             tokenizer)
            text = render_chat(tokenizer, body.conversation(), tools, body.add_generation_prompt,
                               body.continue_final_message, body.chat_template_kwargs)
        except ValueError as error:
            raise ApiError(400, str(error), param_of(str(error)) or "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs or 0
        requested, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                            is not None else (body.max_tokens, "max_tokens"))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        queues = await service.submit_all(request_id, [(ids, text)], lambda length: constrain(body.sampling_params(
            service.defaults, service.resolve_max_tokens(requested, service.kept(length, body), param),
            top if body.logprobs else None),
            tools))
        fmt = service.formatter(request_id, chat=True)
        if body.stream:
            return StreamingResponse(service.stream(request_id, queues, fmt, body, top, tools=tools),
                                     media_type="text/event-stream")
        return fmt.response(await service.final_outputs(request, request_id, queues), body.n, top, tools=tools)

    return routes
