"""Llama 3.x's JSON tool calls (Llama 3.1, 3.2 and 3.3 Instruct with custom tools): the reply is the call object,
with the arguments under ``parameters``; more than one call are joined by ``; `` (as vLLM's ``llama3_json``
parser reads them; Meta's own templates render one call per message)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Its templates write the call back with ``"parameters": `` inside Llama 3's ``<|start_header_id|>`` headers; a
tool result becomes an ``ipython`` message.
"""

from eyas.tools.syntax import CallSyntax

LLAMA3_JSON = CallSyntax("llama3_json", opening="", arguments_key="parameters", suffix="", separator="; ", closing="",
                         trigger='{"name": ', markers=("<|start_header_id|>", '"parameters": '))
