"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes ``{"prompt": text, "add_special_tokens": true}`` or a chat ``{"messages": [...],
"add_generation_prompt": true, "tools": [...]}`` (rendered as ``/v1/chat/completions`` renders it), and
``"return_token_strs": true`` for each token's text; it answers ``{"count", "max_model_len", "tokens",
"token_strs"}``. ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from eyas.server.protocol import ChatCompletionRequest, ChatMessage
from eyas.server.service import ApiError, Service, param_of
from eyas.tools import ToolRequest
from eyas.tools.render import render_chat


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: Any = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def router(service: Service) -> APIRouter:
    routes = APIRouter()
    tokenizer = service.tokenizer

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give either prompt (text) or messages (a chat), not both or neither",
                           "prompt")
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            chat = ChatCompletionRequest(messages=body.messages)
            try:
                tools = ToolRequest.from_openai(body.tools, "none" if body.tools is not None else None,
                                                 tokenizer=tokenizer)
                text = render_chat(tokenizer, chat.conversation(), tools, body.add_generation_prompt,
                                   body.continue_final_message, body.chat_template_kwargs)
            except ValueError as error:
                raise ApiError(400, str(error), param_of(str(error)) or "messages") from None
            special = bool(body.add_special_tokens)
        ids = tokenizer.encode(text, add_special_tokens=special)
        strs = [tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        service.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"tokens: {bad[:5]} are not token ids of this model (0..{tokenizer.vocab_size - 1})",
                           "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return routes
