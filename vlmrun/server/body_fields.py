"""The checks of one scalar field of a request body (type and range), each a 400 naming the field."""

from __future__ import annotations

from typing import Any, Optional, Union

from vlmrun.processors.limits import quote
from vlmrun.server.errors import bad_request


def opt_model(body: dict[str, Any]) -> Optional[str]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return model or None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {quote(value, 40)}", param=name)
    return value


def opt_int(body: dict[str, Any], name: str, default: Any, lo: Optional[int] = None,
             hi: Optional[int] = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {quote(value, 40)}", param=name)
    _check_range(name, value, lo, hi)
    return value


def opt_float(body: dict[str, Any], name: str, default: float, lo: Optional[float] = None,
               hi: Optional[float] = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise bad_request(f"'{name}' must be a number, got {quote(value, 40)}", param=name)
    _check_range(name, value, lo, hi)
    return float(value)


def _check_range(name: str, value: Any, lo: Any, hi: Any) -> None:
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {value}", param=name)


def text_or_token_lists(value: Any, param: str) -> list[Union[str, list[int]]]:
    """A prompt field as OpenAI's completions (and embeddings) take it: a string, a list of strings, a
    list of token ids or a list of such lists -> one item per prompt; a 400 naming `param` otherwise."""
    what = f"'{param}' must be a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        items = [list(value)]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request(what, param=param)
    for item in items:
        if not ((isinstance(item, str) and item) or (isinstance(item, list) and item and all(is_int(t) for t in item))):
            raise bad_request(what + " (and none may be empty)", param=param)
    return items
