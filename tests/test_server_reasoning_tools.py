"""Reasoning before structured outputs, and tool-call arguments streamed piece by piece, through the server.

A live server over the tiny random Qwen3-VL checkpoint with a thinking chat template (the prompt ends
in `<think>\\n`, or in `<think>\\n\\n</think>\\n\\n` with `enable_thinking: false`), driven by the
official `openai` client: its reasoning is noise, closed by `thinking_token_budget`, and the content
after it follows the request's schema or tool calls. The chat output parser is driven directly with
call texts cut in pieces: every call starts with id, name and empty arguments, the argument pieces
join to the final arguments.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmrun.server.chat_output import ChatOutputParser
from testing.tiny_models import CHAT_TEMPLATE
from tests.server_fixtures import served_fixtures
from tests.test_server_structured import NOTE, SHAPES, TIME, WEATHER, assemble

MODEL = "tiny-thinking"
GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' -}}"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(GENERATION_PROMPT, GENERATION_PROMPT + (
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"))


def thinking_checkpoint(request: pytest.FixtureRequest) -> Path:
    """The tiny Qwen3-VL checkpoint with a chat template that opens a `<think>` block."""
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    model_dir = request.getfixturevalue("tmp_path_factory").mktemp("thinking") / "model"
    shutil.copytree(request.getfixturevalue("qwen3_vl_dir"), model_dir)
    (model_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return model_dir


engine, server, client = served_fixtures(thinking_checkpoint, served_model_name=MODEL,
                                         settings={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"})


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 80, "messages": [{"role": "user", "content": "go"}], **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def streamed_chunks(client: openai.OpenAI, **kwargs) -> list:
    return list(chat(client, stream=True, **kwargs))


def joined(chunks) -> tuple[str, str, str]:
    """content, reasoning and finish reason of streamed chunks."""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, reasoning, finish[-1] if finish else None


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": SHAPES}}


# ---------------------------------------------------------------------------- reasoning, then the schema


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_after_free_reasoning(client, temperature):
    out = chat(client, response_format=SCHEMA_FORMAT, temperature=temperature, n=3, seed=3, max_tokens=150,
               extra_body={"thinking_token_budget": 6})
    assert any(choice.finish_reason == "stop" for choice in out.choices), "no choice completed its schema"
    for choice in out.choices:
        assert choice.message.reasoning_content  # six tokens of noise, outside any schema
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SHAPES)


def test_streamed_json_schema_after_reasoning(client):
    kwargs = dict(response_format=SCHEMA_FORMAT, max_tokens=150, extra_body={"thinking_token_budget": 6})
    content, reasoning, finish = joined(streamed_chunks(client, **kwargs))
    assert finish == "stop" and reasoning
    jsonschema.validate(json.loads(content), SHAPES)
    message = chat(client, **kwargs).choices[0].message  # greedy: the same answer, whole
    assert (message.content, message.reasoning_content) == (content, reasoning)


def test_thinking_turned_off_is_constrained_from_the_first_token(client):
    message = chat(client, response_format=SCHEMA_FORMAT,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert not getattr(message, "reasoning_content", None)
    jsonschema.validate(json.loads(message.content), SHAPES)


def test_required_tool_call_after_reasoning(client):
    choice = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                  extra_body={"thinking_token_budget": 4}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_bad_budget_is_400(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"thinking_token_budget": -1})


# ---------------------------------------------------------------------------- argument deltas on the wire


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_call_starts_then_streams_its_arguments(client, tool_choice):
    kwargs = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120, parallel_tool_calls=False,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    deltas = [call for chunk in streamed_chunks(client, **kwargs) for choice in chunk.choices
              for call in choice.delta.tool_calls or []]
    first, pieces = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.type == "function" and first.function.arguments == ""
    assert first.function.name in ("get_weather", "get_time") and pieces
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in pieces)
    arguments = "".join(d.function.arguments for d in pieces)
    whole = chat(client, **kwargs).choices[0].message.tool_calls[0]  # greedy: the same call
    assert (whole.function.name, whole.function.arguments) == (first.function.name, arguments)
    tool = WEATHER if first.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_the_openai_stream_helper_assembles_the_calls(client):
    kwargs = dict(model=MODEL, temperature=0, max_tokens=200, messages=[{"role": "user", "content": "go"}],
                  tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    with client.chat.completions.stream(**kwargs) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and calls and len(done) == len(calls)
    for call, event in zip(calls, done):
        assert event.name == call.function.name and event.arguments == call.function.arguments
        tool = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


# ---------------------------------------------------------------------------- the parser, piece by piece

QWEN3_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "note", "arguments": {"text": "a}b\\"c"}}\n</tool_call>')
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")


def pieces_of(text: str, size: int, tools=(WEATHER, NOTE), reasoning: bool = True):
    parser = ChatOutputParser(reasoning=reasoning, tools=list(tools))
    return [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_qwen3_arguments_stream_as_raw_json(size):
    pieces = pieces_of(QWEN3_CALLS, size)
    deltas = [c for p in pieces for c in p.calls]
    assert assemble(deltas) == [("get_weather", '{"city": "Oslo", "days": 2}'), ("note", '{"text": "a}b\\"c"}')]
    assert len([d for d in deltas if d.index == 0 and not d.starts_call]) >= 20 // size  # argument-level
    start = next(i for i, p in enumerate(pieces) if p.calls)
    assert pieces[start].calls[0].starts_call and pieces[start].calls[0].name == "get_weather"


def test_xml_arguments_stream_a_parameter_at_a_time():
    deltas = [c for p in pieces_of(XML_CALL, 1) for c in p.calls]
    assert [d.arguments for d in deltas] == ["", "{", '"city": "Oslo"', ', "days": 3', "}"]
    assert assemble(deltas) == [("get_weather", '{"city": "Oslo", "days": 3}')]


@pytest.mark.parametrize("text, calls, content", [
    # cut off by max_tokens: the call it had become, its arguments as far as they went
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', [("get_weather", '{"city": "Os')], ""),
    # not named yet when cut: text
    ('<tool_call>\n{"nam', [], '<tool_call>\n{"nam'),
    # a string of arguments: one piece, when closed
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', [("f", '{"a": 1}')], ""),
    # broken after it was named: still the call, arguments as written
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> tail', [("f", '{"a": 1')], " tail"),
    # the name after the arguments: the call only once closed
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', [("f", '{"a": 1}')], ""),
])
def test_unusual_calls_stream_as_they_parse_whole(text, calls, content):
    whole = ChatOutputParser(reasoning=False, tools=[WEATHER]).parse_all(text)
    assert [(c.name, c.arguments) for c in whole.calls] == calls and whole.content == content
    for size in (1, 3):
        pieces = pieces_of(text, size, reasoning=False)
        assert assemble([c for p in pieces for c in p.calls]) == calls
        assert "".join(p.content for p in pieces) == content


ARG_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-99, 99), st.text(max_size=6)),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=3), max_leaves=6)


@settings(max_examples=40, deadline=None)
@given(args=st.dictionaries(st.text(min_size=1, max_size=5), ARG_VALUES, max_size=4), size=st.integers(1, 9),
       indent=st.sampled_from([None, 1]), prefix=st.sampled_from(["", "ok ", "<think>x</think>\n\n"]))
def test_any_streamed_arguments_join_to_the_final_json(args, size, indent, prefix):
    body = json.dumps({"name": "get_weather", "arguments": args}, ensure_ascii=False, indent=indent)
    text = f"{prefix}<tool_call>\n{body}\n</tool_call>"
    whole = ChatOutputParser(reasoning=True, tools=[WEATHER]).parse_all(text)
    assert len(whole.calls) == 1 and json.loads(whole.calls[0].arguments) == args
    pieces = pieces_of(text, size, tools=[WEATHER])
    assert assemble([c for p in pieces for c in p.calls]) == [("get_weather", whole.calls[0].arguments)]
