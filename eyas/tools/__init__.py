"""Tool calling: the request's tools (``spec``), the prompt they are rendered into (``render``), the grammar
that keeps a call valid (``grammar``) and the calls read back out of the generated text (``parse``), in the
call syntax the model's chat template knows (``syntaxes``: Hermes's ``<tool_call>``, Llama 3.x's JSON,
Mistral's ``[TOOL_CALLS]``; Hermes's for templates that know no tools).
"""

from eyas.tools.parse import ParsedReply, ToolCall, parse_reply
from eyas.tools.spec import Tool, ToolRequest

__all__ = ["ParsedReply", "Tool", "ToolCall", "ToolRequest", "parse_reply"]
