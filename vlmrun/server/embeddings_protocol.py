"""The `/v1/embeddings` body (OpenAI's fields, vLLM's extensions), checked: a 400 naming the field.

Two forms, as vLLM takes them: `input` (a string, a list of strings, a list of token ids, or a list of
such lists; raw text, no chat template) or `messages` (one chat, with image / video parts, through the
chat template; `add_generation_prompt` defaults to false here, as vLLM's embedding chat request).
`encoding_format` "float" (lists of floats) or "base64" (each vector's float32 little-endian bytes);
`dimensions` (Matryoshka), vLLM's `normalize`, `truncate_prompt_tokens`, `add_special_tokens` and the
chat template fields of `chat_prompt.py`. A generation-only field (`max_tokens`, `temperature`, `stream`,
...) is a 400 naming it; so is a field this route does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from vlmrun.pooling.params import PoolingParams
from vlmrun.server.body_fields import opt_bool, opt_int, opt_model, text_or_token_lists
from vlmrun.server.chat_prompt import ChatPromptOptions, chat_prompt_options
from vlmrun.server.errors import bad_request
from vlmrun.server.protocol import RequestLimits, _check_messages

ENCODING_FORMATS = ("float", "base64")
_FIELDS = {"model", "input", "messages", "encoding_format", "dimensions", "user", "normalize",
           "truncate_prompt_tokens", "add_special_tokens", "add_generation_prompt", "continue_final_message",
           "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "documents", "priority", "request_id"}
_GENERATION_ONLY = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
                    "stream_options", "stop", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "tools",
                    "tool_choice", "response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "echo", "best_of", "min_tokens", "ignore_eos", "bad_words",
                    "allowed_token_ids", "skip_special_tokens"}


@dataclass
class EmbeddingRequest:
    model: Optional[str]
    inputs: list[Union[str, list[int]]]  # the `input` form (empty with `messages`)
    messages: Optional[list[Any]]  # the chat form
    chat: ChatPromptOptions
    params: PoolingParams
    encoding_format: str = "float"
    add_special_tokens: bool = True  # the `input` form: the tokenizer's special tokens (vLLM's default)

    @property
    def num_prompts(self) -> int:
        return 1 if self.messages is not None else len(self.inputs)


def parse_embedding_request(body: dict[str, Any], limits: RequestLimits) -> EmbeddingRequest:
    generation = sorted(set(body) & _GENERATION_ONLY)
    if generation:
        raise bad_request(f"'{generation[0]}' is a generation option; /v1/embeddings computes embeddings "
                          f"and takes none", param=generation[0])
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad_request(f"unknown field '{unknown[0]}' for /v1/embeddings (its fields: {', '.join(sorted(_FIELDS))})",
                          param=unknown[0])
    has_input, has_messages = body.get("input") is not None, body.get("messages") is not None
    if has_input == has_messages:
        raise bad_request("send either 'input' (text or token ids) or 'messages' (a chat, with images), not "
                          f"{'both' if has_input else 'neither'}", param="input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"'encoding_format' must be float or base64, got {fmt!r}", param="encoding_format")
    params = PoolingParams(dimensions=opt_int(body, "dimensions", None),
                           normalize=None if body.get("normalize") is None else opt_bool(body, "normalize", True),
                           truncate_prompt_tokens=opt_int(body, "truncate_prompt_tokens", None, lo=-1))
    messages = None
    if has_messages:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of {'role', 'content'} objects", param="messages")
        messages = _check_messages(messages)
    chat = chat_prompt_options({**body, "add_generation_prompt": body.get("add_generation_prompt", False)})
    inputs = text_or_token_lists(body["input"], "input") if has_input else []
    return EmbeddingRequest(opt_model(body), inputs, messages, chat, params, fmt,
                            opt_bool(body, "add_special_tokens", True))
