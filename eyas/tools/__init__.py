"""Tool calling: the request's tools (``spec``), the prompt they are rendered into (``render``), the grammar
that keeps a call valid (``grammar``) and the calls read back out of the generated text (``parse``).

Every part speaks one call syntax, Hermes's (the one Qwen's and NousResearch's templates know)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from eyas.tools.parse import ParsedReply, ToolCall, parse_reply
from eyas.tools.spec import Tool, ToolRequest

__all__ = ["ParsedReply", "Tool", "ToolCall", "ToolRequest", "parse_reply"]
