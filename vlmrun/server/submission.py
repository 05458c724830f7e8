"""The steps both generation endpoints share, from the body read to the answer sent.

One request goes: body read on the event loop (JSON only: 415; capped: 413) → JSON parse +
validation in a thread pool (400) → model check (404) → admission (429) → image fetch +
preprocessing + chat template + `bad_words` tokenized in a thread pool (400; stopped at the next
image when the client leaves) → the output constraint compiled in the `GrammarPool` (not started
when the client has left) → `AsyncEngine.submit` (400 for what the engine refuses, e.g. a prompt longer than the
context; 503 if the engine is gone) → a streamed (SSE) or a collected answer (a request that is not
streamed is submitted with `stream=False`: the engine hands each choice's whole answer over once, at its
end, and nothing per step; the body is the same). From submission on,
every exit path aborts what is unfinished and releases the admission. Two pools: large bodies,
large texts and requests with images or videos run in the media pool, everything else in the light
pool, so a small request never waits behind another client's image decoding or megabytes of text;
constraints compile in a third (`grammar_pool.py`). Nothing a client sends is tokenized or compiled
on the engine thread.

What differs per route (preparing the prompts, the response bodies and stream chunks) is in
`chat_handler.py` and `completions_handler.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlmrun.lora.peft_files import LoRAError
from vlmrun.lora.request import LoRARequest
from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.engine.prompt_truncation import truncate_prompt
from vlmrun.engine.request_group import ChoiceDelta, EngineDeadError, EngineStepError, RequestGroup
from vlmrun.sampling_params import SamplingParamError, SamplingParams
from vlmrun.structured import StructuredOutputError
from vlmrun.server import responses as R
from vlmrun.server.errors import APIError, bad_request, internal, unavailable
from vlmrun.server.metrics import ServerMetrics
from vlmrun.server.protocol import parse_json
from vlmrun.server.scheduling_fields import SchedulingFields
from vlmrun.server.state import LIGHT_BODY_BYTES, ServerState, Ticket
from vlmrun.server.transport import SSEResponse, read_json_body, until_done_or_disconnected

logger = logging.getLogger(__name__)
request_log = logging.getLogger("vlmrun.server.requests")  # --enable-log-requests (shown by `vlmrun serve`)


# ---------------------------------------------------------------------------- per-request metrics


class RequestTracker:
    """Feeds one request's timings and counts into the server metrics (vlmrun's and vLLM's), from its choices'
    first-token deltas and last deltas, never per token (a choice that is not streamed brings two deltas):

    - time to first token: the engine's time of the step that brought the request's first token
      (`ChoiceDelta.first_token_time`), minus the request's arrival at the server;
    - time per output token (`vlmrun_time_per_output_token_seconds`), per finished choice of more than one
      token: (the engine's time of its last token - of its first) / (its tokens - 1);
    - e2e: from arrival to the moment the event loop has the request's last delta (at `close`).

    Generated tokens and the inter-token latencies are counted on the engine thread for every request
    (`engine/token_timing.py`), read at scrape time from the stats snapshot."""

    def __init__(self, metrics: ServerMetrics, arrival: float,
                 items: Optional[list[tuple[ProcessedPrompt, SamplingParams]]] = None, n: int = 1):
        self.metrics = metrics
        self.arrival = arrival
        items = items or []
        self.vllm = metrics.vllm.request(arrival, [len(p.token_ids) for p, _ in items],
                                         [getattr(params, "max_tokens", None) for _, params in items],
                                         n)
        self._seen_first = False
        self._closed = False

    def on_batch(self, batch: list[ChoiceDelta]) -> None:
        self.vllm.on_batch(batch, time.monotonic())
        for d in batch:
            if d.first_token_time is not None and not self._seen_first:
                self._seen_first = True
                self.metrics.ttft.observe(max(0.0, d.first_token_time - self.arrival))
            if d.finished:
                self.metrics.finished.labels(d.finish_reason or "unknown").inc()
                if d.first_token_time is not None and d.finished_time is not None and d.num_output_tokens > 1:
                    self.metrics.tpot.observe(max(0.0, d.finished_time - d.first_token_time) / (d.num_output_tokens - 1))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.vllm.close()
            if self._seen_first:
                self.metrics.e2e.observe(time.monotonic() - self.arrival)


def merge_batch(batch: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice: consecutive deltas of a choice (a slow reader) are joined."""
    merged: dict[int, ChoiceDelta] = {}
    for d in batch:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = dataclasses.replace(d, token_ids=list(d.token_ids), logprobs=list(d.logprobs))
            continue
        text, token_ids, logprobs = m.text + d.text, m.token_ids + d.token_ids, m.logprobs + d.logprobs
        if d.finished:  # the last delta's end fields (counts, reasons, times) with the text of all
            m = merged[d.index] = dataclasses.replace(d, first_token_time=m.first_token_time or d.first_token_time)
        m.text, m.token_ids, m.logprobs = text, token_ids, logprobs
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


async def parse_body(state: ServerState, request: Request, parse: Callable[[dict[str, Any], int], Any]) -> Any:
    """The request body read (capped, JSON only) and parsed by `parse` in a pool (400 if invalid)."""
    raw = await read_json_body(request, state.settings.max_request_bytes)
    request.state.large_body = len(raw) > LIGHT_BODY_BYTES
    try:
        parsed = await state.in_pool(lambda: parse(parse_json(raw), state.limits), heavy=request.state.large_body)
    except BaseException:
        state.trimmer.after_body(len(raw), refused=True)  # its buffers are going
        raise
    state.trimmer.after_body(len(raw))
    return parsed


def large_body(request: Request) -> bool:
    """Whether the request's body (read by `parse_body`) was large: its preparation goes to the media pool."""
    return bool(getattr(request.state, "large_body", False))


Prepare = Callable[[threading.Event], list[tuple[ProcessedPrompt, SamplingParams]]]


async def submit(state: ServerState, request: Request, rid: str, ticket: Ticket, arrival: float,
                 prepare: Prepare, prompt_tokens: Callable[[list[tuple[ProcessedPrompt, SamplingParams]]], int],
                 param: str, heavy: bool, lora: Optional[LoRARequest] = None,
                 scheduling: SchedulingFields = SchedulingFields(), n: int = 1, bulk: bool = False,
                 stream: bool = True) -> Submitted:
    """Prepare the request off the event loop (`heavy`: in the media pool; `bulk`: images of many
    megapixels, in the one-thread bulk pool) and hand it to the engine (with `scheduling`'s priority and
    cache salt; `stream` False for an answer collected whole: the engine hands out no per-step output).
    A client that leaves while it is prepared sets `prepare`'s event, which stops it at the next image.
    `n`: the choices of each prompt (consecutive items), for the metrics."""
    cancel = threading.Event()
    try:
        tokenizer = state.processor.tokenizer
        work = state.in_pool(lambda: _input_errors_as_400(lambda: _tokenize_bad_words(prepare(cancel), tokenizer)),
                             heavy, bulk)
        try:
            items = await until_done_or_disconnected(request, work)
        except BaseException:
            if heavy:  # media refused half-way leave buffers behind: hand them back
                state.trimmer.schedule()
            raise
        finally:
            cancel.set()  # done, or nobody is waiting for it any more
        if heavy:  # huge images decoded and resized: their buffers, once the RSS shows them
            state.trimmer.after_media()
        gone = threading.Event()  # set when the client leaves: its compile, if not started, never starts
        if isinstance(items[0][1], SamplingParams):  # the choices of one request share their constraint
            await until_done_or_disconnected(request, state.grammars.compile(items[0][1].structured_outputs, gone))
        items = _truncate_prompts(items, state.engine.engine.max_model_len)
        items = [(scheduling.salted(prompt), params) for prompt, params in items]
        _check_context(items, state.engine.engine.max_model_len)
        group = await state.engine.submit(rid, items, lora, priority=scheduling.priority, stream=stream)
    except LoRAError as exc:  # the adapter the request's `model` names cannot be served
        ticket.release()
        raise bad_request(str(exc), param="model") from None
    except (StructuredOutputError, SamplingParamError) as exc:  # the engine's checks (a grammar, token ids)
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
    choices = [R.ChoiceState(i, num_prompt_tokens=len(p.token_ids), prompt_token_ids=p.token_ids)
               for i, (p, _) in enumerate(items)]
    if state.settings.log_requests:
        log_request(rid, items, lora, state.settings.max_log_len)
    return Submitted(rid, int(time.time()), group, ticket, RequestTracker(state.metrics, arrival, items, n), n_prompt,
                     choices)


def log_request(rid: str, items: list[tuple[ProcessedPrompt, SamplingParams]], lora: Optional[LoRARequest],
                max_log_len: Optional[int] = None) -> None:
    """vLLM's --enable-log-requests: one line per request accepted by the engine (its prompt text cut to
    `max_log_len` characters, vLLM's --max-log-len)."""
    prompt, params = items[0]
    text = prompt.text if max_log_len is None or prompt.text is None else prompt.text[:max_log_len]
    request_log.info("request %s: %d choice(s), %d prompt tokens%s, prompt %r, %s", rid, len(items),
                     len(prompt.token_ids), "" if lora is None else f", adapter {lora.lora_name}", text, params)


def _truncate_prompts(items: list[tuple[ProcessedPrompt, SamplingParams]],
                      max_model_len: int) -> list[tuple[ProcessedPrompt, SamplingParams]]:
    """Each prompt cut as its `truncate_prompt_tokens` says, before the context check (as vLLM); a cut
    through an image is a SamplingParamError naming the field."""
    return [(truncate_prompt(p, params.truncate_prompt_tokens, max_model_len), params) for p, params in items]


def _check_context(items: list[tuple[ProcessedPrompt, SamplingParams]], max_model_len: int) -> None:
    """400, as vLLM answers, for a prompt whose requested completion cannot fit the context."""
    for prompt, params in items:
        n = len(prompt.token_ids)
        if isinstance(params, SamplingParams) and params.max_tokens is not None and n + params.max_tokens > max_model_len:
            raise bad_request(f"this model's maximum context length is {max_model_len:,} tokens; the request asks "
                              f"for {n + params.max_tokens:,} ({n:,} in the prompt, {params.max_tokens:,} to "
                              "generate): shorten the prompt or lower max_tokens", param="max_tokens",
                              code="context_length_exceeded")


def _tokenize_bad_words(items: list[tuple[ProcessedPrompt, SamplingParams]],
                        tokenizer: Any) -> list[tuple[ProcessedPrompt, SamplingParams]]:
    """The items with their `bad_words` tokenized here, in a pool (once per distinct params: the choices
    of a request share them), so that the engine's own `tokenize_bad_words` finds them done."""
    done: dict[int, SamplingParams] = {}
    out = []
    for prompt, params in items:
        key = id(params)
        if key not in done:
            done[key] = params.tokenize_bad_words(tokenizer) if isinstance(params, SamplingParams) else params
        out.append((prompt, done[key]))
    return out


def _input_errors_as_400(prepare: Callable[[], Any]) -> Any:
    try:
        return prepare()
    except (InputError, APIError, StructuredOutputError):
        raise
    except ValueError as exc:  # e.g. a checkpoint without a chat template
        raise bad_request(str(exc)) from None


def record(choice: R.ChoiceState, d: ChoiceDelta) -> None:
    """Add a delta of `choice` to what is collected of it: text, tokens, logprobs, finish reason."""
    choice.text += d.text
    choice.token_ids += d.token_ids
    choice.logprobs += d.logprobs
    if d.finished:
        choice.finish_reason, choice.prompt_logprobs = d.finish_reason, d.prompt_logprobs
        choice.stop_reason = d.stop_reason


async def _collect(sub: Submitted) -> None:
    """Every choice's text, tokens, logprobs and finish reason, gathered into `sub.choices`."""
    async for batch in sub.group:
        sub.tracker.on_batch(batch)
        for d in batch:
            record(sub.choices[d.index], d)


async def respond_collected(request: Request, sub: Submitted,
                             build: Callable[[], dict[str, Any]]) -> Response:
    """Collect every choice to the end (or until the client leaves), then answer `build()` as JSON."""
    try:
        await until_done_or_disconnected(request, _collect(sub))
    except (EngineStepError, EngineDeadError) as exc:
        raise internal(str(exc)) from None
    finally:
        sub.finish()
    return JSONResponse(build())


def stream_response(sub: Submitted, events: Callable[[], AsyncIterator[bytes]]) -> Response:
    """An SSE response of `events()`; an error half-way ends the stream with an error event and [DONE]."""

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
