"""Request bodies of the OpenAI API → validated dataclasses and `SamplingParams`.

Parsing is strict about the fields the server uses (type and range, with the field named in the
error) and lenient about the rest: unknown fields are ignored, as OpenAI-compatible servers do,
except features this server does not have (legacy `functions`, suffix), which are refused with 400
rather than silently ignored.

`logit_bias`, `allowed_token_ids`, `bad_words`: `logits_processor_fields.py`; the chat template's fields
(`add_generation_prompt`, `continue_final_message`, `chat_template`, `chat_template_kwargs`,
`mm_processor_kwargs`, `documents`, `add_special_tokens`): `chat_prompt.py`; vLLM's other fields, and
those this server refuses for want of a counterpart: `vllm_fields.py`; the scalar checks: `body_fields.py`.

Structured outputs: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}) or vLLM's `structured_outputs` object (json / regex /
choice / grammar / json_object) or its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` fields: at most one of them per request. Chat requests may carry `tools` and
`tool_choice` (`tool_calls.py`): "required" or a named function constrain the output to tool calls
by a grammar (the handler builds it, in the chat template's call format) and cannot be combined with
another constraint. Where OpenAI is strict, so is this server:
JSON only (no NaN / Infinity), nesting at most `MAX_JSON_DEPTH` deep, `temperature` in [0, 2],
known chat roles, a `content` on every message (null only beside assistant `tool_calls`), and a
`tool` message only in answer to an earlier tool call.

Extensions beyond OpenAI's fields (vLLM's names): `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`, `thinking_token_budget` (at most that many tokens inside `<think>…</think>`,
then `</think>` is forced), `echo` (chat: see `chat_prompt.py`; completions: the prompt before each
answer, with `logprobs` its tokens' logprobs first, and with `max_tokens` 0 the prompt alone).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from vlmrun.processors.limits import quote
from vlmrun.sampling_params import MAX_LOGPROBS, SamplingParamError, SamplingParams, StopLimits
from vlmrun.beam_search import BeamSearchParams
from vlmrun.server.beam_fields import beam_search_params
from vlmrun.server.body_fields import is_int, opt_bool, opt_float, opt_int, opt_model, text_or_token_lists
from vlmrun.server.chat_prompt import ChatPromptOptions, chat_prompt_options
from vlmrun.server.errors import APIError, bad_request
from vlmrun.server.logits_processor_fields import logits_processor_fields
from vlmrun.server.prompt_bounds import PromptBounds, message_text_chars
from vlmrun.server.scheduling_fields import SchedulingFields
from vlmrun.server.tool_calls import check_tools, forced_tools
from vlmrun.server.vllm_fields import (OutputExtras, echo_prompt_logprobs, vllm_output_extras, vllm_sampling_fields,
                                       with_generation_defaults)
from vlmrun.structured import GrammarLimits, StructuredOutputError, StructuredOutputsParams

MAX_JSON_DEPTH = 64  # arrays / objects nested deeper than this are refused (a real request nests < 10)
MAX_TEMPERATURE = 2.0  # OpenAI's range
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: `max_n` choices, stop strings / ids within `stop`, an output constraint
    within `grammar`, prompt text within `prompt` (None: unchecked here); defaults for the rest."""

    max_n: int
    stop: StopLimits = field(default_factory=StopLimits)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the checkpoint's generation_config
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    prompt: Optional[PromptBounds] = None
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: logprobs / top_logprobs / prompt_logprobs above it are a 400
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: the request field's default
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: every stream ends with its usage
    vocab_size: Optional[int] = None  # the model's logits: token-id lists longer than it are refused at once

    def check_prompt_chars(self, chars: int, params: SamplingParams, param: str) -> None:
        """400 when `chars` characters of prompt text can never fit the context (before tokenizing)."""
        if self.prompt is not None:
            self.prompt.check(chars, params.truncate_prompt_tokens is not None, param)

    def check_prompt_size(self, prompt: Union[str, list[int]], params: SamplingParams, param: str) -> None:
        """400 when a completion prompt (text or token ids) can never fit the context."""
        if self.prompt is not None:
            self.prompt.check_prompt(prompt, params.truncate_prompt_tokens is not None, param)


@dataclass
class ChatRequest:
    model: Optional[str]
    messages: list[Any]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt: ChatPromptOptions = ChatPromptOptions()
    echo: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function tools, for the template
    tool_choice: Any = "none"  # "none" | "auto" | "required" | a tool's name
    forced_tools: list[dict[str, Any]] = field(default_factory=list)  # what a grammar must force a call of
    parallel_tool_calls: bool = True
    extras: OutputExtras = OutputExtras()
    scheduling: SchedulingFields = SchedulingFields()  # priority, cache_salt
    beam: Optional[BeamSearchParams] = None  # use_beam_search (`beam_fields.py`)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class CompletionRequest:
    model: Optional[str]
    prompts: list[Union[str, list[int]]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is generated, as in vLLM)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text prompt
    extras: OutputExtras = OutputExtras()
    scheduling: SchedulingFields = SchedulingFields()  # priority, cache_salt
    beam: Optional[BeamSearchParams] = None  # use_beam_search (`beam_fields.py`)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or 400: not JSON (NaN and Infinity included), not an object,
    or nested deeper than MAX_JSON_DEPTH (however deep: the parser's own recursion is caught)."""
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                          code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # NaN / Infinity, an integer of more than 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_depth(body)
    return body


def parse_chat_request(body: dict[str, Any], limits: RequestLimits) -> ChatRequest:
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {'role', 'content'} objects", param="messages")
    messages = _check_messages(messages)
    logprobs = opt_bool(body, "logprobs", False)
    top = opt_int(body, "top_logprobs", 0, lo=0)
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = opt_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", None, lo=1)
    tools, tool_choice = check_tools(body)
    structured = _structured_outputs(body, limits)
    forced = forced_tools(tools, tool_choice)
    if forced and len(json.dumps(forced)) > limits.grammar.max_source_chars:  # a grammar is compiled from them
        raise bad_request(f"the tools a tool_choice forces are {len(json.dumps(forced)):,} characters of JSON; at "
                          f"most {limits.grammar.max_source_chars:,} are allowed", param="tools")
    if forced and structured is not None:
        raise bad_request("'tool_choice' 'required' or a named function cannot be combined with "
                          "response_format / structured outputs", param="tool_choice")
    params = _sampling_params(body, limits, max_tokens, top if logprobs else None, structured)
    limits.check_prompt_chars(message_text_chars(messages), params, "messages")
    prompt = chat_prompt_options(body)
    return ChatRequest(model=opt_model(body), messages=messages, params=params, stream=opt_bool(body, "stream", False),
                       include_usage=_include_usage(body, limits), logprobs=logprobs, top_logprobs=top, prompt=prompt,
                       echo=opt_bool(body, "echo", False), tools=tools, tool_choice=tool_choice, forced_tools=forced,
                       parallel_tool_calls=opt_bool(body, "parallel_tool_calls", True),
                       extras=vllm_output_extras(body, chat=True, tokens_as_ids=limits.tokens_as_ids),
                       scheduling=SchedulingFields.of(body), beam=beam_search_params(body, params))


def parse_completion_request(body: dict[str, Any], limits: RequestLimits) -> CompletionRequest:
    _refuse_unsupported(body)
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported by this server", param="suffix")
    prompts = text_or_token_lists(body.get("prompt"), "prompt")
    logprobs = opt_int(body, "logprobs", None, lo=0)
    echo = opt_bool(body, "echo", False)
    max_tokens = opt_int(body, "max_tokens", 16, lo=0 if echo else 1)
    extras = vllm_output_extras(body, chat=False, tokens_as_ids=limits.tokens_as_ids)  # the body as sent: a streamed prompt_logprobs is a 400
    body = echo_prompt_logprobs(body, echo, logprobs)
    params = _sampling_params(body, limits, max(max_tokens, 1), logprobs, _structured_outputs(body, limits))
    for p in prompts:
        limits.check_prompt_size(p, params, "prompt")
    best_of = opt_int(body, "best_of", None, lo=1)
    beam = beam_search_params(body, params)
    if best_of is not None and best_of != params.n and beam is None:
        raise bad_request("'best_of' other than 'n' is not supported", param="best_of")
    return CompletionRequest(model=opt_model(body), prompts=prompts, params=params,
                             stream=opt_bool(body, "stream", False), include_usage=_include_usage(body, limits),
                             logprobs=logprobs, echo=echo, echo_only=max_tokens == 0,
                             add_special_tokens=opt_bool(body, "add_special_tokens", True),
                             extras=dataclasses.replace(extras, prompt_logprobs=params.prompt_logprobs),
                             scheduling=SchedulingFields.of(body), beam=beam)


# ---------------------------------------------------------------------------- pieces


def _sampling_params(body: dict[str, Any], limits: RequestLimits, max_tokens: Optional[int],
                     logprobs: Optional[int], structured: Optional[StructuredOutputsParams]) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if isinstance(stop, str) and not stop:
        stop = None
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(is_int(t) and t >= 0 for t in stop_ids)):
        raise bad_request("'stop_token_ids' must be a list of non-negative integers", param="stop_token_ids")
    kwargs = dict(
        n=opt_int(body, "n", 1, lo=1, hi=limits.max_n),
        temperature=opt_float(body, "temperature", 1.0, lo=0.0, hi=MAX_TEMPERATURE),
        top_p=opt_float(body, "top_p", 1.0, lo=0.0, hi=1.0),
        top_k=opt_int(body, "top_k", 0, lo=-1),
        min_p=opt_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=opt_float(body, "repetition_penalty", 1.0, lo=0.0),
        presence_penalty=opt_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=opt_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        seed=opt_int(body, "seed", None),
        max_tokens=max_tokens,
        min_tokens=opt_int(body, "min_tokens", 0, lo=0),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=opt_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        include_stop_str_in_output=opt_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=opt_bool(body, "skip_special_tokens", True),
        structured_outputs=structured,
        thinking_token_budget=opt_int(body, "thinking_token_budget", None, lo=0),
        **logits_processor_fields(body, limits.vocab_size),
        **vllm_sampling_fields(body),
    )
    _check_max_logprobs(body, logprobs, limits.max_logprobs)
    if kwargs["top_p"] == 0.0:
        raise bad_request("'top_p' must be in (0, 1]", param="top_p")
    try:
        params = SamplingParams(**with_generation_defaults(kwargs, body, limits.sampling_defaults))
        limits.stop.check(params)
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    return params


def _check_max_logprobs(body: dict[str, Any], logprobs: Optional[int], most: int) -> None:
    """400, as vLLM answers, for logprobs (the chat top_logprobs) or prompt_logprobs above --max-logprobs."""
    prompt_logprobs = body.get("prompt_logprobs")
    for name, value in (("top_logprobs" if "top_logprobs" in body else "logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
        if is_int(value) and value > most:
            raise bad_request(f"'{name}' asks for {value} logprobs per token; this server returns at most {most} "
                              "(its --max-logprobs)", param=name)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("functions"):
        raise bad_request("legacy 'functions' are not supported by this server: use 'tools'", param="functions")


_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))


def _structured_outputs(body: dict[str, Any], limits: RequestLimits) -> Optional[StructuredOutputsParams]:
    """The request's one output constraint (see the module docstring), shape- and size-checked; None
    without one."""
    given: list[tuple[str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        given += [("response_format", v) for v in [_response_format(fmt)] if v is not None]
    if body.get("structured_outputs") is not None:
        given.append(("structured_outputs", body["structured_outputs"]))
    given += [(name, {kind: body[name]}) for name, kind in _GUIDED_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise bad_request(f"give at most one output constraint, got {', '.join(n for n, _ in given)}",
                          param=given[1][0])
    if not given:
        return None
    param, value = given[0]
    try:
        spec = StructuredOutputsParams.of(value)
        limits.grammar.check(spec)
        return spec
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=param) from None


def _response_format(fmt: Any) -> Optional[dict[str, Any]]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format 'json_schema' needs a 'json_schema' object ({'name': ..., "
                              "'schema': {...}})", param="response_format")
        schema = spec.get("schema")
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON Schema object",
                              param="response_format")
        return {"json": schema}
    raise bad_request("response_format 'type' must be 'text', 'json_object' or 'json_schema'",
                      param="response_format")


def _check_messages(messages: list[Any]) -> list[Any]:
    """OpenAI's rules for chat messages (see the module docstring); `developer` becomes `system`.

    Content parts are checked later, by the processor."""
    call_ids: set[str] = set()  # ids of the tool calls made by earlier assistant messages
    checked = []
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"{where} has no 'role' string", param="messages")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where} has the unknown role {quote(role, 40)} (expected {', '.join(CHAT_ROLES)})",
                              param="messages")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(tool_calls, list):
            call_ids.update(c["id"] for c in tool_calls if isinstance(c, dict) and isinstance(c.get("id"), str))
        if message.get("content") is None and not tool_calls:
            raise bad_request(f"{where} ({role}) has no content: 'content' must be a string or a list of parts",
                              param="messages")
        call_id = message.get("tool_call_id")
        if role == "tool" and not (isinstance(call_id, str) and call_id in call_ids):
            raise bad_request(f"{where}: a 'tool' message must answer a tool call of an earlier assistant "
                              "message ('tool_call_id' names none)", param="messages")
        checked.append({**message, "role": "system"} if role == "developer" else message)
    return checked


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep() -> APIError:
    return bad_request(f"the request body nests arrays / objects more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")


def _check_depth(body: Any) -> None:
    """400 when arrays / objects nest deeper than MAX_JSON_DEPTH (walked without recursion)."""
    stack = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _include_usage(body: dict[str, Any], limits: RequestLimits) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return limits.force_include_usage and body.get("stream") is True
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    if body.get("stream") is not True:  # vLLM and OpenAI refuse it too, rather than ignore it
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
    return opt_bool(opts, "include_usage", False) or limits.force_include_usage


__all__ = ["APIError", "ChatRequest", "CompletionRequest", "RequestLimits", "parse_json", "parse_chat_request",
           "parse_completion_request"]
