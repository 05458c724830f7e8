"""`/v1/embeddings`: text, token ids or a chat with images in, one embedding per input out.

On a server started for pooling (`vlmrun serve --runner pooling`). The shared steps (body, model,
admission, preparation in a pool, submission, the error shape) are `submission.py`'s; here the inputs
become prompts (raw text as /v1/completions tokenizes it, or the chat through the template with its
media, as /v1/chat/completions renders it), each one engine request with the body's `PoolingParams`,
and the answer is OpenAI's list of embeddings with `usage`. On a generation server the route is a 400
saying how to start one (`app.py`).
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from typing import Any, Optional

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlmrun.engine.request_group import EngineDeadError, EngineStepError
from vlmrun.processors import ProcessedPrompt
from vlmrun.pooling.params import PoolingParams
from vlmrun.server.chat_handler import has_media, render_chat
from vlmrun.server.completions_handler import _raw_prompt
from vlmrun.server.embeddings_protocol import EmbeddingRequest, parse_embedding_request
from vlmrun.server.errors import bad_request, internal
from vlmrun.server.state import ServerState
from vlmrun.server.submission import large_body, parse_body, submit
from vlmrun.server.transport import until_done_or_disconnected


async def embeddings(state: ServerState, request: Request) -> Response:
    """Answer one `/v1/embeddings` request."""
    arrival = time.monotonic()
    req: EmbeddingRequest = await parse_body(state, request, parse_embedding_request)
    lora = state.check_model(req.model)
    try:  # dimensions against the checkpoint (Matryoshka) before anything is prepared
        req.params.resolve(state.engine.engine.pooling.config)
    except ValueError as exc:
        raise bad_request(str(exc), param="dimensions") from None
    ticket = state.admission.admit(req.num_prompts)
    rid = f"embd-{uuid.uuid4().hex}"
    heavy = large_body(request) or (req.messages is not None and has_media(req.messages))

    def prepare(cancel: threading.Event) -> list[tuple[ProcessedPrompt, PoolingParams]]:
        if req.messages is not None:
            prompts = [render_chat(state, req.messages, [], req.chat, cancel)]
        else:
            prompts = [_raw_prompt(state, p, i, len(req.inputs), req.add_special_tokens)
                       for i, p in enumerate(req.inputs)]
        return [(p, req.params) for p in prompts]

    sub = await submit(state, request, rid, ticket, arrival, prepare,
                       lambda items: sum(len(p.token_ids) for p, _ in items),
                       "messages" if req.messages is not None else "input", heavy=heavy, lora=lora, stream=False)
    vectors: list[Optional[torch.Tensor]] = [None] * len(sub.choices)

    async def collect() -> None:
        async for batch in sub.group:
            sub.tracker.on_batch(batch)
            for d in batch:
                if d.finished:
                    vectors[d.index] = d.pooled

    try:
        await until_done_or_disconnected(request, collect())
    except (EngineStepError, EngineDeadError) as exc:
        raise internal(str(exc)) from None
    finally:
        sub.finish()
    if any(v is None for v in vectors):
        raise internal("an embedding request ended without its embedding")
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    model = state.model_name if lora is None else lora.lora_name
    return JSONResponse({"id": rid, "object": "list", "created": sub.created, "model": model, "data": data,
                         "usage": {"prompt_tokens": sub.prompt_tokens, "total_tokens": sub.prompt_tokens}})


def encode_vector(vector: torch.Tensor, encoding_format: str) -> Any:
    """A float list, or (base64) the vector's float32 little-endian bytes in base64, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def decode_base64(text: str) -> np.ndarray:
    """What a client does with a base64 embedding: float32 values (little-endian)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")
