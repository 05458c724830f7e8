"""Tool calls in Qwen's formats: the request's `tools` checked, a grammar that forces a call, calls parsed.

Qwen3 writes a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; Qwen3.5
(and Qwen3-Coder) as `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>`. `read_call` reads either body, also unfinished (for streaming the
arguments as they are written), `parse_call` a finished one. `tool_call_grammar` is the EBNF
(xgrammar syntax) of one or more calls of the given tools, the constraint behind
`tool_choice="required"` or a named function: Qwen3-style, each call's JSON valid under
`{"name": <its name>, "arguments": <its parameters schema>}`, or, for a chat template that writes
XML-style calls (`uses_xml_calls`), one `<parameter=KEY>` block per property in schema order
(required ones always, optional ones maybe), a string (or a string enum) as raw text without `<`,
any other value as JSON valid under its schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vlmrun.server.errors import bad_request
from vlmrun.structured.compiler import strict_json_strings

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_CALL_RULE = "vlmrun_tool_call"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


# ---------------------------------------------------------------------------- the request's fields


def check_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The request's `tools` (OpenAI function tools) and `tool_choice` ("none" | "auto" | "required"
    | a tool's name), 400 for anything else. No tools: ([], "none")."""
    tools = body.get("tools")
    if tools is None or tools == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return [], "none"
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {...}} objects", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function needs a 'name' string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                              "'function': {'name': <one of the tools>}}", param="tool_choice")
        return tools, name
    if choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    return tools, choice


def forced_tools(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    """The tools a grammar must force: all for "required", the named one, none otherwise."""
    if choice == "required":
        return tools
    if choice in ("none", "auto"):
        return []
    return [t for t in tools if t["function"]["name"] == choice]


# ---------------------------------------------------------------------------- grammar


def uses_xml_calls(chat_template: Optional[str]) -> bool:
    """True for a chat template that asks for Qwen3.5's XML-style calls (`<function=NAME>`)."""
    return "<function=" in (chat_template or "")


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool = True, xml: bool = False) -> str:
    """EBNF of one (or, with `parallel`, one or more newline-separated) calls of `tools`: Qwen3's
    JSON-style calls, or Qwen3.5's XML-style ones with `xml`."""
    try:
        call = _xml_calls(tools) if xml else _json_calls(tools)
    except Exception as exc:
        raise bad_request(f"the tools' parameters do not compile as JSON Schema: {exc}", param="tools") from None
    text = str(call)
    assert text.startswith("root ::= "), text[:40]
    repeat = f' ("\\n" {_CALL_RULE})*' if parallel else ""
    return f"root ::= {_CALL_RULE}{repeat}\n{_CALL_RULE} ::= {text[len('root ::= '):]}"


def _literal(text: str) -> Any:
    import xgrammar

    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def _json_calls(tools: list[dict[str, Any]]) -> Any:
    import xgrammar

    variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return xgrammar.Grammar.concat(_literal(CALL_OPEN + "\n"), _json_grammar(schema),
                                   _literal("\n" + CALL_CLOSE))


def _xml_calls(tools: list[dict[str, Any]]) -> Any:
    import xgrammar

    calls = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        parts = [_literal(f"{CALL_OPEN}\n<function={fn['name']}>\n")]
        for key, schema in (params.get("properties") or {}).items():
            block = xgrammar.Grammar.concat(_literal(f"<parameter={key}>\n"), _value_grammar(schema),
                                            _literal("\n</parameter>\n"))
            parts.append(block if key in required else xgrammar.Grammar.union(_literal(""), block))
        parts.append(_literal(f"</function>\n{CALL_CLOSE}"))
        calls.append(xgrammar.Grammar.concat(*parts))
    return calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)


def _value_grammar(schema: Any) -> Any:
    import xgrammar

    if _is_string_enum(schema):
        return xgrammar.Grammar.union(*[_literal(v) for v in schema["enum"]])
    plain_string = isinstance(schema, dict) and schema.get("type") == "string" and not (
        {"enum", "const", "pattern", "format"} & set(schema))
    if plain_string:
        return xgrammar.Grammar.from_regex(f"[^<]{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}")
    return _json_grammar(schema if isinstance(schema, dict) else {})


def _json_grammar(schema: dict[str, Any]) -> Any:
    import xgrammar

    return xgrammar.Grammar.from_json_schema(strict_json_strings(json.dumps(schema)), any_whitespace=False)


# ---------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class CallText:
    """A call as far as its text goes: the name, and the arguments JSON text so far. Read again from
    a longer text, the arguments only grow (what was streamed stays a prefix)."""

    name: str
    arguments: str


def parse_call(body: str, tools: Sequence[dict[str, Any]] = ()) -> Optional[ToolCall]:
    """The call in the text between `<tool_call>` and `</tool_call>`, or None when it is neither form."""
    call = read_call(body, tools, closed=True)
    return None if call is None else ToolCall(call.name, call.arguments)


def read_call(body: str, tools: Sequence[dict[str, Any]] = (), closed: bool = True) -> Optional[CallText]:
    """The call in `body` (the text after `<tool_call>`; up to `</tool_call>` when `closed`), or None:
    not a call, or (not closed) not far enough to say.

    Qwen3's JSON body: the arguments are the raw text of its `"arguments"` object, streamable once
    `"name"` is read and the object has begun; a closed body that is not valid JSON is still the call
    its streamed start announced, with the arguments as far as they went. A body with the arguments
    as a JSON string (or before the name) is a call only when closed. A key given twice counts the
    first time, streamed or not (the stream has announced the first name by the time a second one
    could be read). Qwen3.5's XML body: the
    arguments object is written a parameter at a time (a value ends only at `</parameter>`), an
    XML-style parameter being JSON unless `tools` declares it a string (then its raw text)."""
    text = body.lstrip()
    if text.startswith("{"):
        return _read_json_call(text, closed)
    if text.startswith("<function="):
        return _read_xml_call(text, tools, closed)
    return None


def _read_json_call(text: str, closed: bool) -> Optional[CallText]:
    members, pending = _json_members(text)
    if closed:
        try:
            obj = json.loads(text, object_pairs_hook=_first_wins)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            name, args = obj.get("name"), obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, (dict, str)):
                return None
            if isinstance(args, str):
                return CallText(name, args)
            span = members.get("arguments")
            return CallText(name, text[span[0]:span[1]] if span else "{}")
    name = _streamed_name(text, members, pending)
    if name is None:
        return None
    if "arguments" in members:
        start, end = members["arguments"]
        return CallText(name, text[start:end])
    start = pending[1]
    partial = text[start:].rstrip()
    if not closed:
        partial = partial[:len(partial) - held_back(partial, CALL_CLOSE)].rstrip()
    return CallText(name, partial)


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose repeated keys keep their first value (as `_json_members` reads them)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj.setdefault(key, value)
    return obj


def _streamed_name(text: str, members: dict[str, tuple[int, int]], pending: Optional[tuple[str, int]]) -> Optional[str]:
    """The call's name once `"name"` has been read and then an `"arguments"` object began; else None."""
    span = members.get("name")
    args_start = members["arguments"][0] if "arguments" in members else (
        pending[1] if pending is not None and pending[0] == "arguments" else None)
    if span is None or args_start is None or span[0] > args_start or not text.startswith("{", args_start):
        return None
    name = json.loads(text[span[0]:span[1]])
    return name if isinstance(name, str) else None


_DECODER = json.JSONDecoder()


def _json_members(text: str) -> tuple[dict[str, tuple[int, int]], Optional[tuple[str, int]]]:
    """The top-level members of the JSON object `text` begins, as far as they are complete: key ->
    (start, end) of its value; and the member whose value has begun but not ended, as (key, start)."""
    members: dict[str, tuple[int, int]] = {}
    i = _skip_ws(text, 1)
    while i < len(text) and text[i] == '"':
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        i = _skip_ws(text, i)
        if not text.startswith(":", i):
            break
        start = _skip_ws(text, i + 1)
        if start >= len(text):
            break
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return members, (key, start)
        after = _skip_ws(text, end)
        if after >= len(text):  # a number may go on; anything else is complete but its member's end unknown
            return members, (key, start)
        members.setdefault(key, (start, end))
        if text[after] != ",":
            break
        i = _skip_ws(text, after + 1)
    return members, None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (what a stream holds
    back until the next piece says whether the marker follows)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_XML_NAME = re.compile(r"<function=([^>\n]+)>")


def _read_xml_call(text: str, tools: Sequence[dict[str, Any]], closed: bool) -> Optional[CallText]:
    head = _XML_NAME.match(text)
    if head is None:
        return None
    name = head.group(1).strip()
    strings = _string_parameters(tools, name)
    pieces = []
    for key, value in _XML_PARAMETER.findall(text, head.end()):
        key = key.strip()
        parsed = value if key in strings else _parse_value(value)
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(parsed, ensure_ascii=False)}")
    return CallText(name, "{" + ", ".join(pieces) + ("}" if closed else ""))


def _string_parameters(tools: Sequence[dict[str, Any]], name: str) -> set[str]:
    for tool in tools:
        if tool["function"]["name"] == name:
            props = (tool["function"].get("parameters") or {}).get("properties") or {}
            return {k for k, schema in props.items()
                    if isinstance(schema, dict) and (schema.get("type") == "string" or _is_string_enum(schema))}
    return set()


def _is_string_enum(schema: Any) -> bool:
    values = schema.get("enum") if isinstance(schema, dict) else None
    return bool(values) and all(isinstance(v, str) and "<" not in v for v in values)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
