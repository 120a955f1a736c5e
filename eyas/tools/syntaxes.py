"""The tool-call syntaxes eyas knows, and the one a chat template gets.

A template that writes one of them itself (``CallSyntax.knows``) gets it, rendered natively: the template is
handed ``tools`` and the calls. Any other template gets Hermes's syntax, rendered generically
(``eyas.tools.render``). A new syntax is a new file and one line here.
"""

from __future__ import annotations

from eyas.tools.hermes import HERMES
from eyas.tools.llama3_json import LLAMA3_JSON
from eyas.tools.mistral import MISTRAL
from eyas.tools.syntax import CallSyntax

SYNTAXES: tuple[CallSyntax, ...] = (HERMES, LLAMA3_JSON, MISTRAL)
GENERIC = HERMES  # the syntax a template without tool support is taught in its system prompt


def for_template(template: str | None) -> tuple[CallSyntax, bool]:
    """(the syntax, whether the template renders it itself)."""
    for syntax in SYNTAXES:
        if template is not None and syntax.knows(template):
            return syntax, True
    return GENERIC, False
