"""``POST /v1/responses``: OpenAI's Responses API over the chat path (``responses_api`` has the shapes).

Streaming sends the API's events, each as ``event: <type>`` plus ``data: <json>`` with a
``sequence_number``: ``response.created``, ``response.in_progress``; for the text,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` (each
piece), ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for each tool call, ``response.output_item.added``, ``response.function_call_arguments.delta`` (each
piece), ``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete`` past ``max_output_tokens``) with the whole response.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from eyas.server.responses_api import ResponsesRequest, call_item, message_item, output_items, response_body
from eyas.server.service import ApiError, Service, param_of
from eyas.server.tool_stream import ReplyDeltas
from eyas.tools import ToolRequest
from eyas.tools.grammar import constrain
from eyas.tools.render import render_chat


class _Events:
    """The stream's events, numbered; the output items it has opened, in order."""

    def __init__(self):
        self.sequence = 0
        self.items: list[dict] = []  # output items, as sent so far
        self.text_item: int | None = None  # index of the message item in items
        self.call_items: dict[int, int] = {}  # call index -> index in items

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def delta(self, delta: dict):
        """Events for one ``ReplyDeltas`` delta."""
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = len(self.items)
                self.items.append(message_item("", status="in_progress"))
                item = self.items[-1]
                yield self.event("response.output_item.added", output_index=self.text_item, item=item)
                yield self.event("response.content_part.added", item_id=item["id"], output_index=self.text_item,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            item = self.items[self.text_item]
            item["content"][0]["text"] += delta["content"]
            yield self.event("response.output_text.delta", item_id=item["id"], output_index=self.text_item,
                             content_index=0, delta=delta["content"])
        for call in delta.get("tool_calls", []):
            if call["index"] not in self.call_items:
                self.call_items[call["index"]] = len(self.items)
                self.items.append(call_item(call["id"], call["function"]["name"], "", status="in_progress"))
                yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=self.items[-1])
            position = self.call_items[call["index"]]
            piece = call["function"]["arguments"]
            if piece:
                self.items[position]["arguments"] += piece
                yield self.event("response.function_call_arguments.delta", item_id=self.items[position]["id"],
                                 output_index=position, delta=piece)

    def close(self):
        """The ``.done`` events of every open item."""
        for position, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                yield self.event("response.output_text.done", item_id=item["id"], output_index=position,
                                 content_index=0, text=part["text"])
                yield self.event("response.content_part.done", item_id=item["id"], output_index=position,
                                 content_index=0, part=part)
            else:
                yield self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=position, arguments=item["arguments"])
            yield self.event("response.output_item.done", output_index=position, item=item)


def router(service: Service) -> APIRouter:
    routes = APIRouter()
    tokenizer = service.tokenizer

    @routes.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        service.check(body, {"previous_response_id": "this server is stateless and stores no responses; send the "
                                                     "earlier output items back in input"})
        if body.n != 1:
            raise ApiError(400, "n: the Responses API makes one response", "n")
        try:
            tools = ToolRequest.from_openai(body.tools, body.tool_choice, body.parallel_tool_calls,
                                             tokenizer)
            text = render_chat(tokenizer, body.messages(), tools)
        except ValueError as error:
            raise ApiError(400, str(error), param_of(str(error)) or "input") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        queues = await service.submit_all(response_id, [(ids, text)], lambda length: constrain(body.sampling_params(
            service.defaults, service.resolve_max_tokens(body.max_output_tokens, length, "max_output_tokens"), None),
            tools))
        model = service.settings.model_name
        if not body.stream:
            final = (await service.final_outputs(request, response_id, queues))[0]
            return response_body(response_id, body, model, created, output_items(final.outputs[0], tools), final)

        async def events():
            stream, deltas = _Events(), ReplyDeltas(tools)
            yield stream.event("response.created", response=response_body(response_id, body, model, created, [], None))
            yield stream.event("response.in_progress",
                               response=response_body(response_id, body, model, created, [], None))
            async for _, out in service.outputs(response_id, queues):
                completion = out.outputs[0]
                for event in stream.delta(deltas.update(completion.text, out.finished)):
                    yield event
                if out.finished:
                    for event in stream.close():
                        yield event
                    whole = response_body(response_id, body, model, created, stream.items, out)
                    kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
                    yield stream.event(kind, response=whole)

        return StreamingResponse(events(), media_type="text/event-stream")

    return routes
