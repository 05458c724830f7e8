"""The two generation endpoints: `/v1/chat/completions` and `/v1/completions`.

One request goes: body read on the event loop (JSON only: 415; capped: 413) → JSON parse +
validation in a thread pool (400) → model check (404) → admission (429) → image fetch +
preprocessing + chat template in a thread pool (400; stopped at the next image when the client
leaves) → `AsyncEngine.submit` (400 for what the engine refuses, e.g. a prompt longer than the
context; 503 if the engine is gone) → a streamed (SSE) or a collected answer. From submission on,
every exit path aborts what is unfinished and releases the admission. Two pools: large bodies and
requests with images or videos run in the media pool, everything else in the light pool, so a small
request never waits behind another client's image decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.processors.chat import check_unicode
from vlmrun.engine.request_group import ChoiceDelta, EngineDeadError, EngineStepError, RequestGroup
from vlmrun.sampling_params import SamplingParams
from vlmrun.server.chat_output import ChatOutputParser
from vlmrun.server.tool_calls import tool_call_grammar, uses_xml_calls
from vlmrun.structured import StructuredOutputError, StructuredOutputsParams
from vlmrun.server import responses as R
from vlmrun.server.errors import APIError, bad_request, internal, unavailable
from vlmrun.server.metrics import ServerMetrics
from vlmrun.server.protocol import (ChatRequest, CompletionRequest, parse_chat_request,
                                    parse_completion_request, parse_json, split_choices)
from vlmrun.server.state import LIGHT_BODY_BYTES, ServerState, Ticket
from vlmrun.server.transport import SSEResponse, read_json_body, until_done_or_disconnected

logger = logging.getLogger(__name__)

_RESERVED_TOKENS = ("<|image_pad|>", "<|video_pad|>")


# ---------------------------------------------------------------------------- per-request metrics


class RequestTracker:
    """Feeds one request's timings and token counts into the server metrics."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self._first_token: dict[int, float] = {}
        self._seen_first = False
        self._closed = False

    def on_batch(self, batch: list[ChoiceDelta]) -> None:
        now = time.monotonic()
        for d in batch:
            if d.token_ids:
                self.metrics.generation_tokens.inc(len(d.token_ids))
                self._first_token.setdefault(d.index, now)
                if not self._seen_first:
                    self._seen_first = True
                    self.metrics.ttft.observe(now - self.arrival)
            if d.finished:
                self.metrics.finished.labels(d.finish_reason or "unknown").inc()
                first = self._first_token.get(d.index)
                if first is not None and d.num_output_tokens > 1:
                    self.metrics.tpot.observe((now - first) / (d.num_output_tokens - 1))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._seen_first:
                self.metrics.e2e.observe(time.monotonic() - self.arrival)


def merge_batch(batch: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice: consecutive deltas of a choice (a slow reader) are joined."""
    merged: dict[int, ChoiceDelta] = {}
    for d in batch:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = ChoiceDelta(d.index, list(d.token_ids), list(d.logprobs), d.text, d.finished,
                                          d.finish_reason, d.num_prompt_tokens, d.num_output_tokens,
                                          d.first_token_time)
            continue
        m.token_ids += d.token_ids
        m.logprobs += d.logprobs
        m.text += d.text
        if d.finished:
            m.finished, m.finish_reason = True, d.finish_reason
            m.num_prompt_tokens, m.num_output_tokens = d.num_prompt_tokens, d.num_output_tokens
    return sorted(merged.values(), key=lambda d: d.index)


# ---------------------------------------------------------------------------- shared steps


@dataclass
class Submitted:
    """A request accepted by the engine, with what its responses need."""

    rid: str
    created: int
    group: RequestGroup
    ticket: Ticket
    tracker: RequestTracker
    prompt_tokens: int
    choices: list[R.ChoiceState] = field(default_factory=list)

    def finish(self) -> None:
        self.group.abort()
        self.ticket.release()
        self.tracker.close()


async def _parse(state: ServerState, request: Request, parse: Callable[[dict[str, Any], int], Any]) -> Any:
    raw = await read_json_body(request, state.settings.max_request_bytes)
    return await state.in_pool(lambda: parse(parse_json(raw), state.limits), heavy=len(raw) > LIGHT_BODY_BYTES)


Prepare = Callable[[threading.Event], list[tuple[ProcessedPrompt, SamplingParams]]]


async def _submit(state: ServerState, request: Request, rid: str, ticket: Ticket, arrival: float,
                  prepare: Prepare, prompt_tokens: Callable[[list[tuple[ProcessedPrompt, SamplingParams]]], int],
                  param: str, heavy: bool) -> Submitted:
    """Prepare the request off the event loop (`heavy`: in the media pool) and hand it to the engine. A
    client that leaves while it is prepared sets `prepare`'s event, which stops it at the next image."""
    cancel = threading.Event()
    try:
        work = state.in_pool(lambda: _input_errors_as_400(lambda: _compile_grammars(state, prepare(cancel))), heavy)
        try:
            items = await until_done_or_disconnected(request, work)
        finally:
            cancel.set()  # done, or nobody is waiting for it any more
        _check_context(items, state.engine.engine.max_model_len)
        group = await state.engine.submit(rid, items)
    except StructuredOutputError as exc:
        ticket.release()
        raise bad_request(str(exc), param=exc.field) from None
    except InputError as exc:
        ticket.release()
        raise bad_request(str(exc), param=param) from None
    except EngineDeadError as exc:
        ticket.release()
        raise unavailable(str(exc)) from None
    except BaseException:
        ticket.release()
        raise
    n_prompt = prompt_tokens(items)
    state.metrics.prompt_tokens.inc(n_prompt)
    choices = [R.ChoiceState(i, num_prompt_tokens=len(p.token_ids)) for i, (p, _) in enumerate(items)]
    return Submitted(rid, int(time.time()), group, ticket, RequestTracker(state.metrics, arrival), n_prompt, choices)


def has_media(messages: Any) -> bool:
    """Whether chat `messages` hold any content part other than text (images and videos to fetch and decode)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not (isinstance(part, dict) and part.get("type") == "text") for part in m["content"])
        for m in messages)


def _check_context(items: list[tuple[ProcessedPrompt, SamplingParams]], max_model_len: int) -> None:
    """400, as vLLM answers, for a prompt whose requested completion cannot fit the context."""
    for prompt, params in items:
        n = len(prompt.token_ids)
        if params.max_tokens is not None and n + params.max_tokens > max_model_len:
            raise bad_request(f"this model's maximum context length is {max_model_len:,} tokens; the request asks "
                              f"for {n + params.max_tokens:,} ({n:,} in the prompt, {params.max_tokens:,} to "
                              "generate): shorten the prompt or lower max_tokens", param="max_tokens",
                              code="context_length_exceeded")


def _compile_grammars(state: ServerState, items: list[tuple[ProcessedPrompt, SamplingParams]]) -> list[
        tuple[ProcessedPrompt, SamplingParams]]:
    """Compile the requests' grammars here, off the engine thread (StructuredOutputError if bad)."""
    for _, params in items[:1]:  # the choices of one request share their constraint
        state.engine.compile_structured(params)
    return items


def _input_errors_as_400(prepare: Callable[[], Any]) -> Any:
    try:
        return prepare()
    except (InputError, APIError, StructuredOutputError):
        raise
    except ValueError as exc:  # e.g. a checkpoint without a chat template
        raise bad_request(str(exc)) from None


async def _collect(sub: Submitted) -> None:
    async for batch in sub.group:
        sub.tracker.on_batch(batch)
        for d in batch:
            c = sub.choices[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs
            if d.finished:
                c.finish_reason = d.finish_reason


async def _respond_collected(request: Request, sub: Submitted,
                             build: Callable[[], dict[str, Any]]) -> Response:
    try:
        await until_done_or_disconnected(request, _collect(sub))
    except (EngineStepError, EngineDeadError) as exc:
        raise internal(str(exc)) from None
    finally:
        sub.finish()
    return JSONResponse(build())


def _stream(sub: Submitted, events: Callable[[], AsyncIterator[bytes]]) -> Response:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events():
                yield chunk
        except (EngineStepError, EngineDeadError) as exc:
            yield R.sse(R.error_event(str(exc)))
            yield R.SSE_DONE
        except Exception as exc:  # a bug: the status line is out, so the stream says it and ends cleanly
            logger.exception("unexpected error while streaming %s", sub.rid)
            yield R.sse(R.error_event(f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"))
            yield R.SSE_DONE
        finally:
            sub.finish()

    return SSEResponse(guarded(), on_close=sub.finish)


# ---------------------------------------------------------------------------- chat


async def chat_completions(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req: ChatRequest = await _parse(state, request, parse_chat_request)
    state.check_model(req.model)
    ticket = state.admission.admit(req.params.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    prompt_text = ""

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, SamplingParams]]:
        nonlocal prompt_text
        messages = state.media.resolve_messages(req.messages)
        prompt = state.processor.process_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                              tools=req.tools or None, chat_template_kwargs=req.chat_template_kwargs,
                                              cancel=cancel)
        prompt_text = prompt.text
        return [(prompt, p) for p in split_choices(_chat_params(state, req))]

    sub = await _submit(state, request, rid, ticket, arrival, prepare, lambda items: len(items[0][0].token_ids),
                        "messages", heavy=has_media(req.messages))
    model = state.model_name
    token_text = R.TokenText(state.engine.tokenizer)
    parsers = [ChatOutputParser(state.settings.reasoning_parser is not None,
                                req.tools if req.parses_tool_calls else (), prompt_text)
               for _ in sub.choices]

    if not req.stream:
        def build() -> dict[str, Any]:
            for c, parser in zip(sub.choices, parsers):
                if parser.active:
                    c.parsed = parser.parse_all(c.text)
            return R.chat_completion(rid, sub.created, model, sub.choices, req.logprobs, req.top_logprobs,
                                     token_text, sub.prompt_tokens)

        return await _respond_collected(request, sub, build)

    async def events() -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]]) -> bytes:
            return R.sse(R.chat_chunk(rid, sub.created, model, choices, req.include_usage))

        for c in sub.choices:
            yield chunk([R.chat_chunk_choice(c.index, {"role": "assistant", "content": ""})])
        completion_tokens = 0
        async for batch in sub.group:
            sub.tracker.on_batch(batch)
            for d in merge_batch(batch):
                completion_tokens += len(d.token_ids)
                lp = (R.chat_logprobs(d.token_ids, d.logprobs, req.top_logprobs, token_text)
                      if req.logprobs and d.token_ids else None)
                if not d.text and lp is None and not d.finished:
                    continue
                parser = parsers[d.index]
                reason = d.finish_reason if d.finished else None
                deltas = [{"content": d.text} if d.text else {}]
                if parser.active:
                    deltas = _stream_deltas(parser, d.text, d.finished)
                    reason = R.with_tool_calls(reason, parser.num_calls)
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    lp_i, reason_i = (lp if i == 0 else None), (reason if last else None)
                    if delta or lp_i is not None or reason_i is not None:
                        yield chunk([R.chat_chunk_choice(d.index, delta, lp_i, reason_i)])
        if req.include_usage:
            yield R.sse(R.usage_chunk(rid, sub.created, model, "chat.completion.chunk", sub.prompt_tokens,
                                      completion_tokens))
        yield R.SSE_DONE

    return _stream(sub, events)


def _chat_params(state: ServerState, req: ChatRequest) -> SamplingParams:
    """The request's params: constrained to calls of its forced tools when tool_choice asks for that,
    and, with a reasoning parser on, any constraint holding only after the reasoning."""
    params = req.params
    if req.forced_tools:
        grammar = tool_call_grammar(req.forced_tools, req.parallel_tool_calls,
                                    xml=uses_xml_calls(state.processor.chat_template))
        params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))
    spec = params.structured_outputs
    if spec is not None and state.settings.reasoning_parser is not None and not spec.after_reasoning:
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, after_reasoning=True))
    return params


def _stream_deltas(parser: ChatOutputParser, text: str, finished: bool) -> list[dict[str, Any]]:
    """The chat deltas of a parsed choice for new text: reasoning, content, the start of each new tool
    call (id, name, arguments "") and pieces of arguments; the arguments a new call already has
    follow in a second delta, so that every call starts with empty arguments, as OpenAI's do."""
    out = parser.feed(text)
    if finished:
        out += parser.finish()
    started = {c.index for c in out.calls if c.starts_call}
    first: dict[str, Any] = {}
    if out.reasoning:
        first["reasoning_content"] = out.reasoning
    if out.content:
        first["content"] = out.content
    now = [c.to_openai() for c in out.calls if c.starts_call or c.index not in started]
    if now:
        first["tool_calls"] = now
    later = [c.to_openai() for c in out.calls if not c.starts_call and c.index in started]
    return [first, {"tool_calls": later}] if later else [first]


# ---------------------------------------------------------------------------- completions


async def completions(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req: CompletionRequest = await _parse(state, request, parse_completion_request)
    state.check_model(req.model)
    n = req.params.n
    ticket = state.admission.admit(n * len(req.prompts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts: list[ProcessedPrompt] = []

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, SamplingParams]]:
        prompts.extend(_raw_prompt(state, p, i, len(req.prompts)) for i, p in enumerate(req.prompts))
        children = split_choices(req.params)
        return [(p, c) for p in prompts for c in children]

    sub = await _submit(state, request, rid, ticket, arrival, prepare,
                        lambda items: sum(len(p.token_ids) for p in prompts), "prompt", heavy=False)
    model = state.model_name
    token_text = R.TokenText(state.engine.tokenizer)
    prefixes = [(_prompt_text(state, p) if req.echo else "") for p in prompts for _ in range(n)]

    if not req.stream:
        return await _respond_collected(request, sub, lambda: R.text_completion(
            rid, sub.created, model, sub.choices, req.logprobs, token_text, prefixes, sub.prompt_tokens))

    async def events() -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]]) -> bytes:
            return R.sse(R.completion_chunk(rid, sub.created, model, choices, req.include_usage))

        offsets = [len(p) for p in prefixes]
        for i, prefix in enumerate(prefixes):
            if prefix:
                yield chunk([R.completion_chunk_choice(i, prefix)])
        completion_tokens = 0
        async for batch in sub.group:
            sub.tracker.on_batch(batch)
            for d in merge_batch(batch):
                completion_tokens += len(d.token_ids)
                lp = None
                if req.logprobs is not None and d.token_ids:
                    lp = R.completion_logprobs(d.token_ids, d.logprobs, req.logprobs, token_text, offsets[d.index])
                offsets[d.index] += len(d.text)
                if not d.text and lp is None and not d.finished:
                    continue
                yield chunk([R.completion_chunk_choice(d.index, d.text, lp, d.finish_reason if d.finished else None)])
        if req.include_usage:
            yield R.sse(R.usage_chunk(rid, sub.created, model, "text_completion", sub.prompt_tokens,
                                      completion_tokens))
        yield R.SSE_DONE

    return _stream(sub, events)


def _raw_prompt(state: ServerState, prompt: Union[str, list[int]], index: int, count: int) -> ProcessedPrompt:
    """A completion prompt is raw text (no chat template) or token ids; no image tokens allowed."""
    tokenizer = state.engine.tokenizer
    where = f"prompt {index}" if count > 1 else "the prompt"
    if isinstance(prompt, str):
        check_unicode(prompt, where)
        for token in _RESERVED_TOKENS:
            if token in prompt:
                raise InputError(f"{where} may not contain the reserved token {token!r} (send images to "
                                 "/v1/chat/completions)")
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise InputError(f"{where} is empty")
        return ProcessedPrompt(token_ids=list(ids), text=prompt)
    vocab = len(tokenizer)
    reserved = {tokenizer.convert_tokens_to_ids(t) for t in _RESERVED_TOKENS}
    for tid in prompt:
        if not 0 <= tid < vocab:
            raise InputError(f"{where} has token id {tid}, outside the vocabulary (0..{vocab - 1})")
        if tid in reserved:
            raise InputError(f"{where} may not contain image or video placeholder token ids ({tid})")
    return ProcessedPrompt(token_ids=list(prompt))


def _prompt_text(state: ServerState, prompt: ProcessedPrompt) -> str:
    return prompt.text or state.engine.tokenizer.decode(prompt.token_ids)


__all__ = ["chat_completions", "completions", "merge_batch", "RequestTracker"]
