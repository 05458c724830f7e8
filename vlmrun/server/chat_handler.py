"""`/v1/chat/completions`: chat messages (with images and videos) in, a chat completion or its SSE stream out.

The steps it shares with `/v1/completions` (parse, admission, preparation off the event loop,
submission, collect or stream) are `vlmrun.server.submission`'s. Here: the chat template and media
preparation (`render_chat`, with the template fields of `chat_prompt.py`; /tokenize renders the same
way), the sampling params a forced tool choice or a reasoning parser
constrains, and the chat deltas, split into reasoning, content and tool calls when a parser is active.
The answer's role and `echo` follow vLLM (`chat_prompt.response_role`, `chat_prompt.echo_text`): the
echoed text comes before the content, streamed as its own chunk after the role's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.sampling_params import SamplingParams
from vlmrun.server import responses as R
from vlmrun.server.chat_output import ChatOutputParser
from vlmrun.server.beam_search_handler import run_beam_search
from vlmrun.server.chat_prompt import ChatPromptOptions, echo_text, response_role, special_tokens_around
from vlmrun.server.errors import bad_request
from vlmrun.server.prompt_bounds import is_heavy_text, message_text_chars
from vlmrun.server.protocol import ChatRequest, parse_chat_request
from vlmrun.server.state import ServerState
from vlmrun.server.submission import (large_body, merge_batch, parse_body, record, respond_collected,
                                      stream_response, submit)
from vlmrun.server.tool_calls import tool_call_grammar, uses_xml_calls
from vlmrun.server.transport import until_done_or_disconnected
from vlmrun.structured import StructuredOutputsParams


async def chat_completions(state: ServerState, request: Request) -> Response:
    """Answer one `/v1/chat/completions` request (collected or streamed)."""
    arrival = time.monotonic()
    req: ChatRequest = await parse_body(state, request, parse_chat_request)
    lora = state.check_model(req.model)
    _check_tool_choice(state, req)
    ticket = state.admission.admit(req.params.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    heavy = (has_media(req.messages) or large_body(request)
             or is_heavy_text(message_text_chars(req.messages), req.params.bad_words))

    prompt_text = ""
    try:  # media URLs fetched first, in the fetch pool: a URL that never answers holds no media thread
        messages = await until_done_or_disconnected(request, state.resolve_media(req.messages))
        bulk = heavy and await state.is_bulk(messages)
    except InputError as exc:
        ticket.release()
        raise bad_request(str(exc), param="messages") from None
    except BaseException:
        ticket.release()
        raise

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, SamplingParams]]:
        nonlocal prompt_text
        if req.prompt.add_special_tokens and any(special_tokens_around(state.processor.tokenizer)):
            raise bad_request("'add_special_tokens' is not supported for this tokenizer (it would put tokens "
                              "around a prompt holding images)", param="add_special_tokens")
        prompt = render_chat(state, messages, req.tools, req.prompt, cancel)
        prompt_text = prompt.text
        prompts.append(prompt)
        if req.beam is not None:  # round one of the search
            return [(prompt, req.beam.round_params())]
        return [(prompt, p) for p in _chat_params(state, req).choices()]

    prompts: list[ProcessedPrompt] = []
    sub = await submit(state, request, rid, ticket, arrival, prepare, lambda items: len(items[0][0].token_ids),
                       "messages", heavy=heavy, lora=lora, scheduling=req.scheduling,
                       n=1 if req.beam else req.params.n, bulk=bulk, stream=req.stream)
    if req.beam is not None:
        await run_beam_search(state, request, sub, prompts, req.beam, req.params.n, lora)
    model = state.model_name if lora is None else lora.lora_name
    token_text = R.TokenText(state.engine.tokenizer, req.extras.tokens_as_ids)
    answer_id = req.extras.answer_id("chatcmpl", rid)
    parsers = [ChatOutputParser(state.settings.reasoning_parser is not None,
                                req.tools if req.parses_tool_calls else (), prompt_text)
               for _ in sub.choices]
    role = response_role(req.messages, req.prompt, state.settings.response_role)
    echo = echo_text(req.messages, role) if req.echo else ""

    if not req.stream:
        def build() -> dict[str, Any]:
            for c, parser in zip(sub.choices, parsers):
                if parser.active:
                    c.parsed = parser.parse_all(c.text)
            response = R.chat_completion(answer_id, sub.created, model, sub.choices, req.logprobs,
                                         req.top_logprobs, token_text, sub.prompt_tokens)
            req.extras.add_to(response, sub.choices, token_text, chat=True)
            for out in response["choices"]:
                message = out["message"]
                message["role"] = role
                if echo:
                    message["content"] = echo + (message["content"] or "")
                if not req.extras.include_reasoning:
                    message.pop("reasoning_content", None)
            return response

        return await respond_collected(request, sub, build)

    async def events() -> AsyncIterator[bytes]:
        return_ids = req.extras.return_token_ids

        def chunk(c: R.ChoiceState, delta: dict[str, Any], token_ids: list[int], lp: Optional[dict[str, Any]] = None,
                  finish_reason: Optional[str] = None) -> bytes:
            choices = [R.chat_chunk_choice(c.index, delta, lp, finish_reason, c.stop_reason)]
            return req.extras.add_to_chunk(R.chat_chunk(answer_id, sub.created, model, choices, req.include_usage),
                                           c, token_ids, chat=True)

        for c in sub.choices:
            yield chunk(c, {"role": role, "content": ""}, [])
        if echo:
            for c in sub.choices:
                yield chunk(c, {"content": echo}, [])
        async for batch in sub.group:
            sub.tracker.on_batch(batch)
            for d in merge_batch(batch):
                c = sub.choices[d.index]
                record(c, d)
                lp = (R.chat_logprobs(d.token_ids, d.logprobs, req.top_logprobs, token_text)
                      if req.logprobs and d.token_ids else None)
                if not d.text and lp is None and not d.finished and not (return_ids and d.token_ids):
                    continue
                parser = parsers[d.index]
                reason = d.finish_reason if d.finished else None
                deltas = [{"content": d.text} if d.text else {}]
                if parser.active:
                    deltas = _stream_deltas(parser, d.text, d.finished)
                    reason = R.with_tool_calls(reason, parser.num_calls)
                    if not req.extras.include_reasoning:
                        deltas = [{k: v for k, v in delta.items() if k != "reasoning_content"} for delta in deltas]
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    lp_i, reason_i = (lp if i == 0 else None), (reason if last else None)
                    ids_i = d.token_ids if i == 0 else []
                    if delta or lp_i is not None or reason_i is not None or (return_ids and ids_i):
                        yield chunk(c, delta, ids_i, lp_i, reason_i)
        if req.include_usage:
            yield R.sse(R.usage_chunk(answer_id, sub.created, model, "chat.completion.chunk", sub.prompt_tokens,
                                      sum(len(c.token_ids) for c in sub.choices)))
        yield R.SSE_DONE

    return stream_response(sub, events)


def render_chat(state: ServerState, messages: list[Any], tools: list[dict[str, Any]], options: ChatPromptOptions,
                cancel: Optional[threading.Event] = None) -> ProcessedPrompt:
    """The messages' prompt as the engine runs it: media fetched by the server's policy, rendered with
    the request's template options over the server's defaults."""
    if options.chat_template is not None and not state.settings.trust_request_chat_template:
        raise bad_request("a per-request 'chat_template' needs a server started with --trust-request-chat-template",
                          param="chat_template")
    if options.mm_processor_kwargs and not state.settings.trust_request_mm_kwargs:
        raise bad_request("a per-request 'mm_processor_kwargs' needs a server started with --trust-request-mm-kwargs "
                          "(or size every request's media with --mm-processor-kwargs)", param="mm_processor_kwargs")
    resolved = state.media.resolve_messages(messages)
    mm_kwargs = options.mm_processor_kwargs  # over the engine's own (--mm-processor-kwargs), which the processor applies
    return state.processor.process_chat(resolved, add_generation_prompt=options.add_generation_prompt,
                                        tools=tools or None, chat_template_kwargs=options.template_variables(),
                                        chat_template=options.chat_template,
                                        continue_final_message=options.continue_final_message,
                                        mm_processor_kwargs=mm_kwargs or None, cancel=cancel)


def _check_tool_choice(state: ServerState, req: ChatRequest) -> None:
    """400, as vLLM answers, for tool_choice "auto" (the default with tools) on a server started without
    --enable-auto-tool-choice: its calls would not be parsed."""
    if req.tools and req.tool_choice == "auto" and not state.settings.enable_auto_tool_choice:
        raise bad_request('tool_choice "auto" (the default with tools) needs a server started with '
                          '--enable-auto-tool-choice and --tool-call-parser; use "required", a named function '
                          'or "none" here', param="tool_choice")


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


def has_media(messages: Any) -> bool:
    """Whether chat `messages` hold any content part other than text (images and videos to fetch and decode)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not (isinstance(part, dict) and part.get("type") == "text") for part in m["content"])
        for m in messages)
