"""A chat reply as OpenAI's stream deltas: its content, and its tool calls as they form.

``ReplyDeltas(tools).update(text, final)`` takes the reply's visible text so far and returns the delta
for what is new since the last call: ``{"content": ...}`` and/or ``{"tool_calls": [...]}``, or ``{}``.
A call's first delta carries its index, id, type and name with the arguments so far; later deltas carry
argument pieces only. Joined in order, the pieces equal the whole reply's arguments (``eyas.tools.parse``).

Example: text ``'<tool_call>\\n{"name": "f", "arguments": {"x": 1'`` then the whole call gives
``{"tool_calls": [{"index": 0, "id": "call_...", "type": "function", "function": {"name": "f",
"arguments": ""}}]}`` (the tail's length is held back), then ``{"tool_calls": [{"index": 0,
"function": {"arguments": '{"x": 1}'}}]}``.
"""

from __future__ import annotations

import uuid

from eyas.tools import ToolRequest, parse_reply


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyDeltas:
    def __init__(self, tools: ToolRequest | None):
        self.parses = tools is not None and bool(tools.callable)  # "none" (or no tools): the reply is content
        self.syntax = tools.syntax if tools is not None else None
        self.content_sent = 0
        self.calls_sent: list[tuple[str, int]] = []  # per call: (its id, argument characters sent)

    def update(self, text: str, final: bool) -> dict:
        if not self.parses:
            delta, self.content_sent = text[self.content_sent:], len(text)
            return {"content": delta} if delta else {}
        reply = parse_reply(text, self.syntax, final)
        out: dict = {}
        if len(reply.content) > self.content_sent:
            out["content"] = reply.content[self.content_sent:]
            self.content_sent = len(reply.content)
        calls = []
        for index, call in enumerate(reply.calls):
            if index == len(self.calls_sent):
                self.calls_sent.append((call_id(), len(call.arguments)))
                calls.append({"index": index, "id": self.calls_sent[index][0], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.calls_sent[index][1]:
                identifier, sent = self.calls_sent[index]
                calls.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self.calls_sent[index] = (identifier, len(call.arguments))
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``"tool_calls"`` for a reply that ended on its calls."""
        return "tool_calls" if engine_reason == "stop" and self.calls_sent else engine_reason
