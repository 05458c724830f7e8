"""Structured outputs, tool calls and reasoning through the server, driven by the official `openai` client.

The live server of test_server.py over the tiny random Qwen3-VL checkpoint (noise when unconstrained): `response_format`
json_schema and json_object, vLLM's `structured_outputs` / `guided_*` fields, `tools` with
"required", a named function and "auto" (streamed and not), `<think>` split into
`reasoning_content`, and bad constraints answered with 400 while the server keeps serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from vlmrun.server.chat_output import ChatOutputParser
from tests.test_server import MODEL, client, engine, server  # noqa: F401  (the live server, as fixtures)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {  # a free string: raw text in XML-style calls, even "12"
    "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 6}},
                                   "required": ["text"]}}}
SHAPES = {"type": "object", "properties": {"shapes": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                     "shape": {"enum": ["circle", "square"]}},
    "required": ["colour", "shape"], "additionalProperties": False}}}, "required": ["shapes"],
    "additionalProperties": False}


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 60, "messages": [{"role": "user", "content": "go"}], **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def stream(client: openai.OpenAI, **kwargs) -> tuple[str, str, dict[int, dict], str]:
    """content, reasoning, tool calls by index (arguments joined) and the finish reason of a streamed chat."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


# ---------------------------------------------------------------------------- response formats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": SHAPES}}
    out = chat(client, response_format=fmt, temperature=temperature, n=2, seed=1)
    assert any(choice.finish_reason == "stop" for choice in out.choices), "no choice completed its schema"
    for choice in out.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SHAPES)


def test_response_format_json_object_and_vllm_fields(client):
    out = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    assert out.choices[0].finish_reason == "stop", "the JSON object was not completed"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for extra, check in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
                         ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
                         ({"guided_json": {"type": "boolean"}}, lambda t: t in ("true", "false")),
                         ({"guided_grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac"))]:
        text = chat(client, extra_body=extra).choices[0].message.content
        assert check(text), (extra, text)
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                           extra_body={"guided_choice": ["alpha", "beta"]})
    assert completion.choices[0].text in ("alpha", "beta")


def test_streamed_json_schema_joins_to_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": SHAPES}}
    content, reasoning, calls, finish = stream(client, response_format=fmt)
    assert not reasoning and not calls
    assert finish == "stop", "the streamed answer did not complete its schema"
    jsonschema.validate(json.loads(content), SHAPES)


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
    {"guided_regex": "(unclosed"},
    {"guided_grammar": "root ::= missing"},
    {"response_format": {"type": "yaml"}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(client, body):
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body=body)
    assert chat(client, max_tokens=3).choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------- tools


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        tool = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(args, tool["function"]["parameters"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_and_named(client, temperature):
    out = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=temperature,
               max_tokens=120, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    named = chat(client, tools=[WEATHER, TIME], max_tokens=120, parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    _check_calls(named.message.tool_calls, {"get_time"})


def test_tool_choice_required_streamed(client):
    content, _, calls, finish = stream(client, tools=[WEATHER], tool_choice="required", max_tokens=120,
                                       parallel_tool_calls=False)
    assert finish == "tool_calls" and not content.strip()
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_choice_auto_parses_calls_out_of_the_text(client, streamed):
    # The tiny model writes noise; a regex makes it write a preamble and a call, which "auto" parses.
    force = {"guided_regex": "Sure[.]\n" + re.sub(r"([][(){}.*+?|^$\\])", r"\\\1", CALL_TEXT)}
    kwargs = dict(tools=[WEATHER], tool_choice="auto", max_tokens=100, extra_body=force)
    if streamed:
        content, _, calls, finish = stream(client, **kwargs)
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
    else:
        choice = chat(client, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2})]
    assert content.strip() == "Sure." and finish == "tool_calls"
    plain = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=100, extra_body=force).choices[0]
    assert plain.message.content == "Sure.\n" + CALL_TEXT and not plain.message.tool_calls


@pytest.mark.parametrize("streamed", [False, True])
def test_reasoning_is_split_from_content(client, streamed):
    force = {"guided_regex": "<think>[a-z ]{1,12}</think>\n\nanswer [0-9]"}
    if streamed:
        content, reasoning, _, _ = stream(client, extra_body=force)
    else:
        message = chat(client, extra_body=force).choices[0].message
        content, reasoning = message.content, message.reasoning_content
    assert re.fullmatch("[a-z ]{1,12}", reasoning) and re.fullmatch("answer [0-9]", content)


# ---------------------------------------------------------------------------- the parser, piece by piece


@pytest.mark.parametrize("text", [
    "<think>hmm</think>\n\nhello <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
    "plain <tool_ text <tool_call>broken</tool_call> end",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
    "<thin", "<think>unfinished </thi",
])
def test_streamed_pieces_add_up_to_the_whole_parse(text):
    whole = ChatOutputParser(reasoning=True, tools=[WEATHER]).parse_all(text)
    for size in (1, 3, 7):
        parser = ChatOutputParser(reasoning=True, tools=[WEATHER])
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert "".join(p.reasoning for p in pieces) == whole.reasoning
        assert "".join(p.content for p in pieces) == whole.content
        assert assemble([c for p in pieces for c in p.calls]) == [(c.name, c.arguments) for c in whole.calls]


def assemble(deltas) -> list[tuple[str, str]]:
    """(name, arguments) per call from streamed call deltas: a start (name, arguments "") then pieces."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.starts_call:
            assert d.index == len(calls) and d.arguments == "" and d.id.startswith("call_")
            calls[d.index] = [d.name, ""]
        else:
            calls[d.index][1] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_qwen3_5_xml_calls_and_thinking_prompts_parse():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    parsed = ChatOutputParser(reasoning=True, tools=[WEATHER]).parse_all(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo"})]
    thinking = ChatOutputParser(reasoning=True, prompt_text="<|im_start|>assistant\n<think>\n")
    parsed = thinking.parse_all("plan it</think>\n\ndone")
    assert parsed.reasoning == "plan it" and parsed.content == "done"


@pytest.mark.parametrize("xml", [False, True])
def test_forced_call_grammars_give_calls_the_parser_reads(qwen3_dir, xml):
    from vlmrun.api import LLM
    from vlmrun.sampling_params import SamplingParams
    from vlmrun.server.tool_calls import tool_call_grammar

    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu")
    tools = [WEATHER, TIME, NOTE]
    grammar = tool_call_grammar(tools, parallel=False, xml=xml)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_outputs={"grammar": grammar})
              for seed in range(6)]
    outs = llm.generate(["a"] * 6, params, use_tqdm=False)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        parsed = ChatOutputParser(reasoning=False, tools=tools).parse_all(out.text)
        assert parsed.calls and not parsed.content.strip(), out.text
        for call in parsed.calls:
            tool = next(t for t in tools if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
