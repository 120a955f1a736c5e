"""Mistral's ``[TOOL_CALLS]`` syntax (Mistral 7B Instruct v0.3, Mistral Small, Mixtral 8x22B Instruct): the
calls are one JSON array after the ``[TOOL_CALLS]`` token::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Its templates list the tools in ``[AVAILABLE_TOOLS]``, write each past call with an ``"id"`` of 9 letters
and digits (the last 9 characters of the call id; shorter ids are refused), and a result inside
``[TOOL_RESULTS]`` with that ``call_id``.
"""

import hashlib

from eyas.tools.syntax import CallSyntax

ID_LENGTH = 9


class Mistral(CallSyntax):
    def native_id(self, call_id: str) -> str:
        """Kept when its last 9 characters are letters and digits; else 9 hex digits of its SHA-256 (the call and
        its result map alike). Example: ``call_0`` becomes ``c557a85a0``; ``call_Ab12Cd34Ef`` stays."""
        if len(call_id) >= ID_LENGTH and call_id[-ID_LENGTH:].isalnum() and call_id[-ID_LENGTH:].isascii():
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:ID_LENGTH]


MISTRAL = Mistral("mistral", opening="[TOOL_CALLS] [", arguments_key="arguments", suffix="", separator=", ", closing="]",
                  trigger="[TOOL_CALLS]", markers=("[TOOL_CALLS]",))
