"""OpenAI response bodies built from eyas outputs: completions and chat completions, whole and as
stream chunks, with logprobs (``bytes``: a token's exact bytes, also for part of a character), usage,
tool calls and (optionally) per-request speculation figures."""

from __future__ import annotations

import time

from eyas.engine.outputs import CompletionOutput, RequestOutput
from eyas.model.tokenizer import Tokenizer
from eyas.server.tool_stream import call_id
from eyas.tools import ToolRequest, parse_reply


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def spec_figures(spec: dict) -> dict:
    """A request's speculation in vLLM's metric words (``--per-request-spec-metrics``)."""
    return {"num_drafts": spec.get("num_steps", 0), "num_draft_tokens": spec.get("num_drafted", 0),
            "num_accepted_tokens": spec.get("num_accepted", 0),
            "mean_acceptance_length": spec.get("mean_acceptance_length", 1.0),
            "num_accepted_tokens_per_pos": spec.get("accepted_per_position", []),
            "acceptance_rate_per_pos": spec.get("per_position_acceptance", [])}


def _ends_on_stop_token(completion: CompletionOutput) -> bool:
    return (completion.finish_reason == "stop" and isinstance(completion.stop_reason, int)
            and completion.token_ids[-1:] == [completion.stop_reason])


def chat_message(completion: CompletionOutput, tools: ToolRequest | None) -> tuple[dict, str | None]:
    """The assistant message of a whole reply and its finish reason (``"tool_calls"`` when it ended on calls)."""
    if tools is None or not tools.callable:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    reply = parse_reply(completion.text, tools.syntax)
    message = {"role": "assistant", "content": reply.content or None}
    if not reply.calls:
        return message, completion.finish_reason
    message["tool_calls"] = [{"id": call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in reply.calls]
    return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason


class Formatter:
    """Bodies for one response: its id, creation time and model name are fixed once."""

    def __init__(self, tokenizer: Tokenizer, model: str, response_id: str, chat: bool, spec_metrics: bool):
        self.tokenizer, self.model, self.id, self.chat = tokenizer, model, response_id, chat
        self.created = int(time.time())
        self.spec_metrics = spec_metrics

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- logprobs --------------------------------------------------------------------------------------
    def logprobs(self, completion: CompletionOutput, start: int, end: int, text_offset: int, top: int) -> dict | None:
        """Tokens ``start:end`` of the completion; ``top``: alternatives per token asked for."""
        if completion.logprobs is None:
            return None
        ids, entries = completion.token_ids[start:end], completion.logprobs[start:end]
        if self.chat:
            content = []
            for token_id, entry in zip(ids, entries):
                best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
                text = self._token(token_id)
                content.append({"token": text, "logprob": entry[token_id],
                                "bytes": list(self.tokenizer.token_bytes(token_id)),
                                "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                                  "bytes": list(self.tokenizer.token_bytes(t))} for t, lp in best]})
            return {"content": content}
        tokens = [self._token(t) for t in ids]
        offsets, offset = [], text_offset
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(ids, entries)],
                "top_logprobs": [{self._token(t): lp for t, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                                 for e in entries],
                "text_offset": offsets}

    def with_prompt(self, out: RequestOutput, logprobs: dict, top: int) -> dict:
        """A completion's logprobs after its echoed prompt's (``echo`` with ``logprobs``): the first prompt
        token has none (``null``), as in OpenAI's and vLLM's answers."""
        tokens = [self._token(t) for t in out.prompt_token_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        sampled = [None if e is None else e[t] for t, e in zip(out.prompt_token_ids, out.prompt_logprobs)]
        best = [None if e is None else {self._token(t): lp for t, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                for e in out.prompt_logprobs]
        return {"tokens": tokens + logprobs["tokens"], "token_logprobs": sampled + logprobs["token_logprobs"],
                "top_logprobs": best + logprobs["top_logprobs"], "text_offset": offsets + logprobs["text_offset"]}

    # -- whole responses -------------------------------------------------------------------------------
    def response(self, outputs: list[RequestOutput], n: int, top: int, echo: list[str] | None = None,
                 tools: ToolRequest | None = None) -> dict:
        """``outputs``: one per prompt; choice index = prompt index * n + sample index; ``tools``: a chat
        request's, whose replies are read for tool calls."""
        choices = []
        for i, out in enumerate(outputs):
            for completion in out.outputs:
                index = i * n + completion.index
                prefix = echo[i] if echo else ""
                logprobs = self.logprobs(completion, 0, len(completion.token_ids), len(prefix), top)
                if self.chat:
                    message, reason = chat_message(completion, tools)
                    choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                else:
                    text = prefix + completion.text
                    if logprobs is not None and out.prompt_logprobs is not None:
                        logprobs = self.with_prompt(out, logprobs, top)
                    choice = {"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": completion.finish_reason}
                choices.append(choice)
        body = {**self._envelope(False), "choices": choices, "usage": usage(outputs)}
        if self.spec_metrics:
            body["spec_decode_metrics"] = [spec_figures(o.spec_metrics) for o in outputs]
        return body

    # -- stream chunks ---------------------------------------------------------------------------------
    def chunk(self, index: int, piece: str | dict, finish_reason: str | None, logprobs: dict | None = None,
              sources: tuple[CompletionOutput, int] | None = None) -> dict:
        """``piece``: a chat choice's delta (a dict), a completion's new text. ``sources``: (completion, first new
        token): list the new tokens and whether each was an accepted draft; the stop token that ended the
        completion is not content, so it is not listed."""
        if self.chat:
            choice = {"index": index, "delta": piece, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
        if sources is not None:
            completion, start = sources
            end = len(completion.token_ids) - _ends_on_stop_token(completion)
            choice["token_sources"] = [{"text": self._token(t), "draft": d} for t, d in
                                       zip(completion.token_ids[start:end], completion.from_draft[start:end])]
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        body = {**self._envelope(True), "choices": [], "usage": usage(outputs)}
        if self.spec_metrics:
            body["spec_decode_metrics"] = [spec_figures(o.spec_metrics) for o in outputs]
        return body
