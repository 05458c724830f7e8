"""`POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

/tokenize takes either `prompt` (a string, tokenized as it is; `add_special_tokens` default true) or
`messages` (a chat: the chat template, images and videos as the chat route prepares them, so the
ids are the ones the engine would run, image and video pads included; `add_special_tokens` default
false, `tools` and the chat template's fields as the chat route takes them, `chat_prompt.py`) and
answers `{"count", "max_model_len", "tokens"}`, plus `token_strs` with `return_token_strs`.
/detokenize takes `tokens` and answers `{"prompt"}` (special tokens kept). Bodies follow the
generation routes' rules: JSON only (415), capped (413), `model` the served one (404), a 400 naming
the field for the rest; chat bodies are checked as /v1/chat/completions checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlmrun.processors import InputError
from vlmrun.processors.chat import check_unicode
from vlmrun.server.chat_handler import has_media, render_chat
from vlmrun.server.chat_prompt import ChatPromptOptions, special_tokens_around
from vlmrun.server.errors import bad_request
from vlmrun.server.body_fields import opt_bool, opt_model
from vlmrun.server.prompt_bounds import is_heavy_text, message_text_chars
from vlmrun.server.protocol import RequestLimits, parse_chat_request
from vlmrun.server.state import ServerState
from vlmrun.server.submission import large_body, parse_body

@dataclass
class TokenizeRequest:
    model: Optional[str]
    prompt: Optional[str]  # the completion form; None: `messages` is given
    messages: list[Any] = field(default_factory=list)
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] = field(default_factory=list)
    options: ChatPromptOptions = ChatPromptOptions()
    return_token_strs: bool = False


@dataclass
class DetokenizeRequest:
    model: Optional[str]
    tokens: list[int]


def parse_tokenize_request(body: dict[str, Any], limits: RequestLimits) -> TokenizeRequest:
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
    model = opt_model(body)
    token_strs = opt_bool(body, "return_token_strs", False)
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string (a chat goes in 'messages')", param="prompt")
        if limits.prompt is not None:  # a text that could never run is not tokenized (the routes' 400)
            limits.prompt.check(len(body["prompt"]), truncating=False, param="prompt")
        try:
            check_unicode(body["prompt"], "the prompt")
        except InputError as exc:  # a lone surrogate: a 400, as the generation routes answer
            raise bad_request(str(exc), param="prompt") from None
        return TokenizeRequest(model, body["prompt"], add_special_tokens=opt_bool(body, "add_special_tokens", True),
                               return_token_strs=token_strs)
    chat = parse_chat_request(body, limits)  # the chat route's rules (and refusals) for messages, tools, template
    return TokenizeRequest(model, None, chat.messages, add_special_tokens=chat.prompt.add_special_tokens,
                           tools=chat.tools, options=chat.prompt, return_token_strs=token_strs)


def parse_detokenize_request(body: dict[str, Any], limits: RequestLimits) -> DetokenizeRequest:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids (integers)", param="tokens")
    return DetokenizeRequest(opt_model(body), tokens)


async def tokenize(state: ServerState, request: Request) -> Response:
    req: TokenizeRequest = await parse_body(state, request, parse_tokenize_request)
    state.check_model(req.model)
    tokenizer = state.processor.tokenizer
    if req.prompt is not None:
        ids = await state.in_pool(lambda: tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens),
                                  heavy=large_body(request) or is_heavy_text(len(req.prompt), None))
    else:
        heavy = has_media(req.messages) or large_body(request) or is_heavy_text(message_text_chars(req.messages), None)
        try:  # media URLs fetched first, in the fetch pool (as for a chat completion)
            messages = await state.resolve_media(req.messages)
        except InputError as exc:
            raise bad_request(str(exc), param="messages") from None
        bulk = heavy and await state.is_bulk(messages)  # images of many pixels: the bulk pool, as for a chat
        ids = await state.in_pool(lambda: _chat_token_ids(state, req, messages), heavy=heavy, bulk=bulk)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(answer)


async def detokenize(state: ServerState, request: Request) -> Response:
    req: DetokenizeRequest = await parse_body(state, request, parse_detokenize_request)
    state.check_model(req.model)
    text = await state.in_pool(lambda: _decode(state, req.tokens), heavy=large_body(request))
    return JSONResponse({"prompt": text})


def _decode(state: ServerState, tokens: list[int]) -> str:
    """The text of `tokens` (in a pool: a long list is checked and decoded off the event loop)."""
    tokenizer = state.processor.tokenizer
    vocab = max(len(tokenizer), state.engine.engine.model_config.text_config.vocab_size)
    unknown = next((t for t in tokens if not 0 <= t < vocab), None)
    if unknown is not None:
        raise bad_request(f"'tokens' holds {unknown}, not a token id of this model (0 to {vocab - 1})",
                          param="tokens")
    return tokenizer.decode(tokens)


def _chat_token_ids(state: ServerState, req: TokenizeRequest, messages: Any) -> list[int]:
    """The chat's ids (its `messages`, media fetched) as the engine would run them (pads expanded), 400 for
    what the processor refuses."""
    try:
        prompt = render_chat(state, messages, req.tools, req.options)
    except InputError as exc:
        raise bad_request(str(exc), param="messages") from None
    except ValueError as exc:  # e.g. a checkpoint without a chat template
        raise bad_request(str(exc)) from None
    if not req.add_special_tokens:
        return list(prompt.token_ids)
    before, after = special_tokens_around(state.processor.tokenizer)
    return before + list(prompt.token_ids) + after
