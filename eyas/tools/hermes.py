"""Hermes's tool-call syntax (NousResearch Hermes, Qwen 2.5 and later), and eyas's generic syntax for templates
that know no tools::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that writes ``<tool_call>`` and reads ``tools`` renders it itself.
"""

from eyas.tools.syntax import CallSyntax

HERMES = CallSyntax("hermes", opening="<tool_call>\n", arguments_key="arguments", suffix="\n</tool_call>",
                    separator="\n<tool_call>\n", closing="", trigger="<tool_call>", markers=("tools", "<tool_call>"))
