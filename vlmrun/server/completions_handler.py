"""`/v1/completions`: raw prompts (text or token ids, no chat template, no images) in, text completions out.

The steps it shares with `/v1/chat/completions` are `vlmrun.server.submission`'s. Here: each
prompt checked and tokenized as it is (no reserved image / video pad tokens), `echo`, and the
completion chunks with their text-offset logprobs.

`echo` as vLLM's: the prompt's text before each answer (none when `return_token_ids` returns the
prompt as ids); with `logprobs`, the prompt tokens' logprobs first (the first token's null); with
`max_tokens` 0, the prompt alone. Streamed, the echoed prompt comes first; with `logprobs` it waits for
its logprobs, which the engine reports when the choice ends, so such a choice comes as one chunk then.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.processors.chat import check_unicode
from vlmrun.sampling_params import SamplingParams
from vlmrun.server import responses as R
from vlmrun.server.prompt_bounds import is_heavy_text
from vlmrun.server.beam_search_handler import run_beam_search
from vlmrun.server.protocol import CompletionRequest, parse_completion_request
from vlmrun.server.state import ServerState
from vlmrun.server.submission import (large_body, merge_batch, parse_body, record, respond_collected,
                                      stream_response, submit)

_RESERVED_TOKENS = ("<|image_pad|>", "<|video_pad|>")


async def completions(state: ServerState, request: Request) -> Response:
    """Answer one `/v1/completions` request (collected or streamed)."""
    arrival = time.monotonic()
    req: CompletionRequest = await parse_body(state, request, parse_completion_request)
    lora = state.check_model(req.model)
    n = req.params.n
    ticket = state.admission.admit(n * len(req.prompts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    heavy = large_body(request) or is_heavy_text(sum(len(p) for p in req.prompts), req.params.bad_words)
    prompts: list[ProcessedPrompt] = []

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, SamplingParams]]:
        prompts.extend(_raw_prompt(state, p, i, len(req.prompts), req.add_special_tokens)
                       for i, p in enumerate(req.prompts))
        children = req.params.choices() if req.beam is None else [req.beam.round_params()]  # a beam: round one
        return [(p, c) for p in prompts for c in children]

    sub = await submit(state, request, rid, ticket, arrival, prepare,
                       lambda items: sum(len(p.token_ids) for p, _ in items[::1 if req.beam else n]), "prompt",
                       heavy=heavy, lora=lora, scheduling=req.scheduling, n=1 if req.beam else n, stream=req.stream)
    if req.beam is not None:
        await run_beam_search(state, request, sub, prompts, req.beam, n, lora)
    model = state.model_name if lora is None else lora.lora_name
    token_text = R.TokenText(state.engine.tokenizer, req.extras.tokens_as_ids)
    answer_id = req.extras.answer_id("cmpl", rid)
    echo = None
    if req.echo:
        echo = R.CompletionEcho([_echo_prefix(state, prompts[c.index // n], c, req.extras.return_token_ids)
                                 for c in sub.choices], only=req.echo_only)

    if not req.stream:
        def build() -> dict[str, Any]:
            response = R.text_completion(answer_id, sub.created, model, sub.choices, req.logprobs, token_text,
                                         echo, sub.prompt_tokens)
            req.extras.add_to(response, sub.choices, token_text, chat=False)
            return response

        return await respond_collected(request, sub, build)

    async def events() -> AsyncIterator[bytes]:
        def chunk(c: R.ChoiceState, text: str, token_ids: list[int], lp: Optional[dict[str, Any]] = None,
                  finish_reason: Optional[str] = None) -> bytes:
            choices = [R.completion_chunk_choice(c.index, text, lp, finish_reason, c.stop_reason)]
            return req.extras.add_to_chunk(R.completion_chunk(answer_id, sub.created, model, choices,
                                                              req.include_usage), c, token_ids, chat=False)

        echo_waits = echo is not None and req.logprobs is not None  # for the prompt's logprobs, at the end
        if echo is not None and not echo_waits:
            for c in sub.choices:
                if echo.prefixes[c.index]:
                    yield chunk(c, echo.prefixes[c.index], [])
        offsets = [0] * len(sub.choices)
        async for batch in sub.group:
            sub.tracker.on_batch(batch)
            for d in merge_batch(batch):
                c = sub.choices[d.index]
                record(c, d)
                reason = d.finish_reason if d.finished else None
                if echo_waits:
                    if d.finished:
                        ids, lps = echo.logprobs(c)
                        lp = R.completion_logprobs(ids, lps, req.logprobs, token_text)
                        yield chunk(c, echo.text(c), c.token_ids, lp, reason)
                    continue
                text = "" if req.echo_only else d.text
                lp = None
                if req.logprobs is not None and d.token_ids:
                    lp = R.completion_logprobs(d.token_ids, d.logprobs, req.logprobs, token_text, offsets[d.index])
                offsets[d.index] += len(text)
                if text or lp is not None or d.finished or (req.extras.return_token_ids and d.token_ids):
                    yield chunk(c, text, d.token_ids, lp, reason)
        if req.include_usage:
            yield R.sse(R.usage_chunk(answer_id, sub.created, model, "text_completion", sub.prompt_tokens,
                                      sum(len(c.token_ids) for c in sub.choices)))
        yield R.SSE_DONE

    return stream_response(sub, events)


def _raw_prompt(state: ServerState, prompt: Union[str, list[int]], index: int, count: int,
                add_special_tokens: bool) -> ProcessedPrompt:
    """A completion prompt is raw text (no chat template; the tokenizer's special tokens with
    `add_special_tokens`) or token ids; no image tokens allowed."""
    tokenizer = state.engine.tokenizer
    where = f"prompt {index}" if count > 1 else "the prompt"
    if isinstance(prompt, str):
        check_unicode(prompt, where)
        for token in _RESERVED_TOKENS:
            if token in prompt:
                raise InputError(f"{where} may not contain the reserved token {token!r} (send images to "
                                 "/v1/chat/completions)")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
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


def _echo_prefix(state: ServerState, prompt: ProcessedPrompt, choice: R.ChoiceState, return_token_ids: bool) -> str:
    """The text `echo` puts before a choice: its prompt as the engine ran it (after truncate_prompt_tokens);
    none when the prompt's ids are returned (vLLM's rule)."""
    if return_token_ids:
        return ""
    if prompt.text and len(prompt.token_ids) == len(choice.prompt_token_ids):
        return prompt.text
    return state.engine.tokenizer.decode(choice.prompt_token_ids)
