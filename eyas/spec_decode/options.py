"""A proposer's options: a frozen dataclass whose fields are the method's own keys of ``speculative_config``
(vLLM's flat names), each with its default, its help text and its command-line flag.

``SpeculativeConfig.from_dict`` routes each key of the flat dict to the options of the method that reads it, and
the ``eyas`` command makes its flags from the same fields, so an option is written once, where its proposer is::

    @dataclass(frozen=True)
    class NgramOptions(MethodOptions):
        prompt_lookup_min: int = option(2, "ngram: smallest n-gram to match", flag="--spec-lookup-min", parse=int)

        def validate(self) -> None:
            if self.prompt_lookup_min < 1:
                raise ValueError(f"speculative_config.prompt_lookup_min: {self.prompt_lookup_min} must be >= 1")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


def option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A field of a ``MethodOptions`` dataclass. ``flag``: its command-line flag (None: none); ``parse`` turns the
    flag's text into the value (a field whose default is a bool is a switch and needs none)."""
    assert flag is None or isinstance(default, bool) or parse is not None, f"{flag}: give parse"
    return field(default=default, metadata={"help": help, "flag": flag, "parse": parse})


@dataclass(frozen=True)
class MethodOptions:
    """Base of a method's options; a method without options uses it as is (no keys)."""

    def validate(self) -> None:
        """Checks of the values; raise ValueError('speculative_config.<key>: <value> must ...')."""

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def changed(self) -> list[str]:
        """The keys whose value is not the default, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]
