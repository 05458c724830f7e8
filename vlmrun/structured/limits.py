"""`GrammarLimits`: how large a client's output constraint may be before anything compiles it.

xgrammar's compile time and memory grow with the constraint (a 100k-choice enum takes minutes and
gigabytes against a 150k-token vocabulary), and a compile cannot be interrupted once it started. So
the server refuses, before compiling, a constraint whose text (the JSON schema, the regex, the
grammar, the choices as a JSON list) is longer than `max_source_chars`, or a `choice` of more than
`max_choices` strings. A `StructuredOutputError` names the field; the server answers it as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrun.structured.params import StructuredOutputError, StructuredOutputsParams


@dataclass(frozen=True)
class GrammarLimits:
    max_source_chars: int = 64 * 1024
    max_choices: int = 1024

    def __post_init__(self) -> None:
        if self.max_source_chars < 1 or self.max_choices < 1:
            raise ValueError("GrammarLimits need max_source_chars >= 1 and max_choices >= 1")

    def check(self, spec: StructuredOutputsParams) -> None:
        """StructuredOutputError when `spec` is past a limit (before any compile)."""
        kind = spec.kind
        if kind == "choice" and len(spec.choice or ()) > self.max_choices:
            raise StructuredOutputError(f"structured_outputs.choice has {len(spec.choice or ()):,} strings; at most "
                                        f"{self.max_choices:,} are allowed")
        size = len(spec.source)
        if size > self.max_source_chars:
            raise StructuredOutputError(f"the {kind} constraint is {size:,} characters long; at most "
                                        f"{self.max_source_chars:,} are allowed (compiling it would hold up others)")
