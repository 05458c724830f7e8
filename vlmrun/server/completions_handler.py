"""`/v1/completions`: raw prompts (text or token ids, no chat template, no images) in, text completions out.

The steps it shares with `/v1/chat/completions` are `vlmrun.server.submission`'s. Here: each
prompt checked and tokenized as it is (no reserved image / video pad tokens), `echo`, and the
completion chunks with their text-offset logprobs.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, AsyncIterator, Union

from fastapi import Request
from fastapi.responses import Response

from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.processors.chat import check_unicode
from vlmrun.sampling_params import SamplingParams
from vlmrun.server import responses as R
from vlmrun.server.protocol import CompletionRequest, parse_completion_request
from vlmrun.server.state import ServerState
from vlmrun.server.submission import merge_batch, parse_body, respond_collected, stream_response, submit

_RESERVED_TOKENS = ("<|image_pad|>", "<|video_pad|>")


async def completions(state: ServerState, request: Request) -> Response:
    """Answer one `/v1/completions` request (collected or streamed)."""
    arrival = time.monotonic()
    req: CompletionRequest = await parse_body(state, request, parse_completion_request)
    state.check_model(req.model)
    n = req.params.n
    ticket = state.admission.admit(n * len(req.prompts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts: list[ProcessedPrompt] = []

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, SamplingParams]]:
        prompts.extend(_raw_prompt(state, p, i, len(req.prompts)) for i, p in enumerate(req.prompts))
        children = req.params.choices()
        return [(p, c) for p in prompts for c in children]

    sub = await submit(state, request, rid, ticket, arrival, prepare,
                       lambda items: sum(len(p.token_ids) for p, _ in items[::n]), "prompt", heavy=False)
    model = state.model_name
    token_text = R.TokenText(state.engine.tokenizer)
    prefixes = [(_prompt_text(state, p) if req.echo else "") for p in prompts for _ in range(n)]

    if not req.stream:
        def build() -> dict[str, Any]:
            response = R.text_completion(rid, sub.created, model, sub.choices, req.logprobs, token_text, prefixes,
                                         sub.prompt_tokens)
            req.extras.add_to(response, sub.choices, token_text, chat=False)
            return response

        return await respond_collected(request, sub, build)

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

    return stream_response(sub, events)


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
