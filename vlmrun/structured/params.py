"""`StructuredOutputsParams`: the constraint one request's output must satisfy (vLLM's names).

Exactly one of:

- `json`: a JSON Schema (a dict, or its JSON text): the output is one JSON value valid under it;
- `json_object=True`: the output is one JSON object (any keys);
- `regex`: the output matches the regular expression (whole output, xgrammar's regex dialect);
- `choice`: the output is exactly one of these strings;
- `grammar`: an EBNF grammar (xgrammar / GBNF syntax, start rule `root`).

`after_reasoning` (default False): the model may first reason in `<think>…</think>`, unconstrained;
the constraint holds from after `</think>` (see `reasoning.py` for how the prompt decides where the
output starts: inside a think, after one, or free to open one). The server sets it for constrained
chat requests when a reasoning parser is on. It does not change the compiled grammar.

`disable_any_whitespace` (vLLM's flag; default True here, unlike vLLM): JSON is generated in one
line with `", "` and `": "` separators. Small models allowed free whitespace tend to emit it
forever; set False to let the model format the JSON as it likes.

Shape errors (none or two constraints, wrong types) raise `StructuredOutputError` when the params
are built; schema / regex / grammar errors are found when the engine compiles them (still before
the request is queued), and raise the same error.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")
FLAGS = ("disable_any_whitespace", "after_reasoning")


class StructuredOutputError(ValueError):
    """A structured-output constraint is malformed or does not compile."""

    field = "structured_outputs"


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = True
    after_reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise StructuredOutputError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {what}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise StructuredOutputError(f"structured_outputs.json must be a JSON Schema (an object or its JSON "
                                        f"text), got {type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise StructuredOutputError("structured_outputs.json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        for flag in ("disable_any_whitespace", "after_reasoning"):
            if not isinstance(getattr(self, flag), bool):
                raise StructuredOutputError(f"structured_outputs.{flag} must be true or false")

    @classmethod
    def of(cls, value: Any) -> "StructuredOutputsParams":
        """`value` as params: params as is, a dict of their fields converted (unknown keys refused)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, "
                                        f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS) - set(FLAGS))
        if unknown:
            raise StructuredOutputError(f"structured_outputs has unknown fields {', '.join(unknown)} "
                                        f"(supported: {', '.join(KINDS + FLAGS)})")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as text: the compile cache's key (with `kind` and the whitespace flag)."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return _json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return self.kind, self.source, self.disable_any_whitespace
