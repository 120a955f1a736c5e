"""The tools of one request and how it may call them, validated once at the edge.

``ToolRequest.from_openai(tools, tool_choice, parallel_tool_calls)`` reads OpenAI's shapes: Chat
Completions' ``{"type": "function", "function": {"name", "description", "parameters"}}`` and the
Responses API's flat ``{"type": "function", "name", "description", "parameters"}``; ``tool_choice``
``"none"``, ``"auto"``, ``"required"``, or a named function in either shape. A bad value is a
ValueError naming the field (``tools[1].function.name: ...``) and what is allowed. The request's call syntax
is the one its chat template knows (``eyas.tools.syntaxes``), as its tokenizer writes it (``CallSyntax.bind``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

from eyas.model.tokenizer import Tokenizer
from eyas.tools.syntax import CallSyntax
from eyas.tools.syntaxes import GENERIC, for_template

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema for the arguments object

    def as_openai(self) -> dict:
        """The Chat Completions shape, as chat templates that know tools expect it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names (choice "named")
    parallel: bool = True  # more than one call per reply
    syntax: CallSyntax = GENERIC  # how the model writes its calls (bound to its tokenizer)

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a reply may call."""
        if self.choice == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return () if self.choice == "none" else self.tools

    @classmethod
    def from_openai(cls, tools, tool_choice=None, parallel_tool_calls=None,
                    tokenizer: Tokenizer | None = None) -> ToolRequest | None:
        """None when the request has no tools and no tool_choice (or tool_choice "none" without tools).
        ``tokenizer``: the model's; its chat template decides the call syntax (None: the generic one)."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise ValueError(f"tool_choice: {tool_choice!r} needs tools; send tools or leave tool_choice out")
            return None
        if not isinstance(tools, list) or not tools:
            raise ValueError(f"tools: must be a non-empty list of function tools (or left out), not {tools!r:.80}")
        parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
        names = [t.name for t in parsed]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"tools[{i}].function.name: {name!r} is given twice; tool names must be unique")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls: {parallel_tool_calls!r} must be true or false")
        choice, named = _choice(tool_choice, names)
        syntax = GENERIC if tokenizer is None else for_template(tokenizer.chat_template)[0].bind(tokenizer)
        return cls(parsed, choice, named, True if parallel_tool_calls is None else parallel_tool_calls, syntax)


def _tool(value, where: str) -> Tool:
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise ValueError(f"{where}: must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"parameters\": {{...}}}}}}, not {json.dumps(value)[:80]}")
    if "function" in value:  # Chat Completions nests the function; the Responses API does not
        body, where = value["function"], f"{where}.function"
        if not isinstance(body, dict):
            raise ValueError(f"{where}: must be an object with name, description and parameters")
    else:
        body = value
    name = body.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"{where}.name: {name!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"{where}.description: must be a string")
    parameters = body.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.parameters: must be a JSON schema object, not {type(parameters).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(parameters)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as error:
        is_error, messages = True, [str(error)]
    if is_error:
        raise ValueError(f"{where}.parameters: the schema cannot be enforced ({messages[0].strip()[:300]})")
    return Tool(name, description, parameters)


def _choice(value, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ValueError(f"tool_choice: {value!r} is not one of {', '.join(CHOICES)} or a named function")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else value.get("name")
        if name not in names:
            raise ValueError(f"tool_choice: names function {name!r}, which is not among the tools {names}")
        return "named", name
    raise ValueError(f"tool_choice: {json.dumps(value)[:80]} must be 'none', 'auto', 'required' or "
                     f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
