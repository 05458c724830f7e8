"""vLLM's request fields of a chat or completions body beyond OpenAI's, and what they add to a response.

Sampling (`SamplingParams` arguments): `prompt_logprobs` (the logprob and top-k of every prompt token
after the first), `truncate_prompt_tokens` (keep the last k prompt tokens; -1: max_model_len),
`spaces_between_special_tokens`. Completions' `echo` with `logprobs` asks for the prompt's logprobs too
(top `logprobs`, unless `prompt_logprobs` is given), as vLLM does (`echo_prompt_logprobs`).

Response (`OutputExtras`): `prompt_logprobs` as vLLM writes them (a list with None first, then
{"token id": {"logprob", "rank", "decoded_token"}} per prompt token; rank only where the token is among
the top-k, else null) — for chat on the response, for completions on each choice; collected answers
only: a streamed `prompt_logprobs` is a 400 naming it, as in vLLM. `return_token_ids`: the prompt's ids
(`prompt_token_ids`) and each choice's `token_ids` in the same places; streamed, the prompt's ids come
once (chat: on each choice's first chunk, beside `choices`; completions: on each choice's first
chunk's choice) and every chunk's choice carries the ids of its own text. `stream_options`
{`include_usage`, `continuous_usage_stats`}: every chunk carries `usage` (that choice's prompt tokens
and the tokens it has so far), the last usage-only chunk stays. `return_tokens_as_token_ids`: logprobs
name their tokens "token_id:<id>". `request_id`: the answer's id is the route's prefix and it
(`chatcmpl-<request_id>`, `cmpl-<request_id>`). Chat `include_reasoning` false: no `reasoning_content`.

Defaults (vLLM's `--generation-config`): a sampling field the body leaves out takes the checkpoint's
`generation_config.json` value (`with_generation_defaults`; read once, `ModelConfig.sampling_defaults`).

Refused with a 400 naming the field, never ignored: chat `best_of` other than `n` (but with
`use_beam_search`, the beam width: `beam_fields.py`), and vLLM's fields
this server has no counterpart for (`WITHOUT_COUNTERPART`: logits
processors by name, KV transfer, extension arguments, structural tags, another
structured-output backend or whitespace pattern, media IO options, prompt embeddings) set to anything
but the value that asks for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vlmrun.server.body_fields import opt_bool
from vlmrun.server.errors import APIError, bad_request
from vlmrun.server.responses import ChoiceState, TokenText, json_logprob, sse, usage


def vllm_sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The `SamplingParams` arguments of vLLM's fields (None / True where absent); SamplingParams checks them."""
    spaces = body.get("spaces_between_special_tokens")
    return dict(prompt_logprobs=body.get("prompt_logprobs"), truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
                spaces_between_special_tokens=True if spaces is None else spaces)


def echo_prompt_logprobs(body: dict[str, Any], echo: bool, logprobs: Optional[int]) -> dict[str, Any]:
    """`body` with vLLM's completions rule applied: `echo` with `logprobs` asks for the prompt's logprobs
    (top `logprobs`) when the body does not ask for them itself."""
    if echo and logprobs is not None and body.get("prompt_logprobs") is None:
        return {**body, "prompt_logprobs": logprobs}
    return body


# vLLM's request fields with no counterpart here: (field, the values that ask for nothing, why). Another
# value is a 400 naming the field; vLLM itself answers so for most when it runs without the feature.
WITHOUT_COUNTERPART = (
    ("logits_processors", ([],), "logits processors by name are not supported (use logit_bias, "
                                 "allowed_token_ids or bad_words)"),
    ("kv_transfer_params", ({},), "KV transfer (disaggregated serving) is not supported by this server"),
    ("vllm_xargs", ({},), "extension arguments are not supported by this server"),
    ("structural_tag", (), "structural tags are not supported: use structured_outputs or response_format"),
    ("guided_decoding_backend", ("xgrammar", "auto"), "the structured-output backend is xgrammar"),
    ("guided_whitespace_pattern", (), "a whitespace pattern for JSON is not supported by this server"),
    ("media_io_kwargs", ({},), "media IO options are not supported: size media with mm_processor_kwargs"),
    ("prompt_embeds", (), "prompt embeddings are not supported by this server"),
)


def vllm_output_extras(body: dict[str, Any], chat: bool, tokens_as_ids: bool = False) -> "OutputExtras":
    """What the body's vLLM fields add to the response; 400 naming a field this server does not act on.
    `tokens_as_ids`: return_tokens_as_token_ids when the body leaves it out (the server's flag)."""
    best_of = body.get("best_of")
    if chat and best_of is not None and best_of != body.get("n", 1) and body.get("use_beam_search") is not True:
        raise bad_request("'best_of' other than 'n' is not supported", param="best_of")
    for name, neutral, why in WITHOUT_COUNTERPART:
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise bad_request(f"'{name}': {why}", param=name)
    if body.get("return_tokens_as_token_ids") is None and tokens_as_ids:
        body = {**body, "return_tokens_as_token_ids": True}
    return OutputExtras.of(body, stream=body.get("stream") is True)


@dataclass(frozen=True)
class OutputExtras:
    """What vLLM's fields add to a response."""

    prompt_logprobs: Optional[int] = None  # the top-k asked for, None when not asked
    return_token_ids: bool = False
    continuous_usage: bool = False  # stream_options include_usage and continuous_usage_stats
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    include_reasoning: bool = True
    request_id: Optional[str] = None

    @classmethod
    def of(cls, body: dict[str, Any], stream: bool) -> "OutputExtras":
        flags = {name: opt_bool(body, name, default) for name, default in (
            ("return_token_ids", False), ("return_tokens_as_token_ids", False), ("include_reasoning", True))}
        prompt_logprobs = body.get("prompt_logprobs")  # its type: checked by SamplingParams
        if prompt_logprobs is not None and stream:
            raise bad_request("'prompt_logprobs' are not available when 'stream' is true (collected answers only)",
                              param="prompt_logprobs")
        request_id = body.get("request_id")
        if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= 256
                                           and request_id.isprintable()):
            raise bad_request("'request_id' must be a printable string of 1 to 256 characters", param="request_id")
        return cls(prompt_logprobs, flags["return_token_ids"], stream and _continuous_usage(body),
                   flags["return_tokens_as_token_ids"], flags["include_reasoning"], request_id)

    def answer_id(self, prefix: str, engine_id: str) -> str:
        """The answer's id: `prefix`-request_id when the body gives one (vLLM's), else the engine's id."""
        return engine_id if self.request_id is None else f"{prefix}-{self.request_id}"

    def add_to(self, response: dict[str, Any], choices: list[ChoiceState], token_text: TokenText, chat: bool) -> None:
        """Write the prompt's fields (on the response for chat, on each choice for completions) and each
        choice's token ids into the collected `response`, in place."""
        if self.prompt_logprobs is None and not self.return_token_ids:
            return
        for out, state in zip(response["choices"], choices):
            prompt_target = response if chat else out
            if self.prompt_logprobs is not None:
                prompt_target["prompt_logprobs"] = vllm_prompt_logprobs(state.prompt_logprobs, self.prompt_logprobs,
                                                                        token_text)
            if self.return_token_ids:
                prompt_target["prompt_token_ids"] = list(state.prompt_token_ids)
                out["token_ids"] = list(state.token_ids)

    def add_to_chunk(self, chunk: dict[str, Any], choice: ChoiceState, token_ids: list[int], chat: bool) -> bytes:
        """`chunk` (one choice's stream chunk) as SSE, with what the fields add: the prompt's ids on the
        choice's first chunk, the chunk's own `token_ids`, and the usage so far (`choice.token_ids` counted)."""
        first, choice.streamed = not choice.streamed, True
        if self.return_token_ids:
            if first:
                (chunk if chat else chunk["choices"][0])["prompt_token_ids"] = list(choice.prompt_token_ids)
            for out in chunk["choices"]:
                out["token_ids"] = list(token_ids)
        if self.continuous_usage:
            chunk["usage"] = usage(choice.num_prompt_tokens, len(choice.token_ids))
        return sse(chunk)


def _continuous_usage(body: dict[str, Any]) -> bool:
    """vLLM's rule: usage on every chunk needs both `include_usage` and `continuous_usage_stats`."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return False  # a bad stream_options is the parser's 400
    try:
        return opt_bool(options, "continuous_usage_stats", False) and options.get("include_usage") is True
    except APIError as exc:
        raise bad_request(f"stream_options: {exc.message}", param="stream_options") from None


def vllm_prompt_logprobs(logprobs: Optional[list[Optional[dict[int, float]]]], top: int,
                         token_text: TokenText) -> Optional[list[Optional[dict[str, Any]]]]:
    """Per prompt position None (the first) or {"token id": {"logprob", "rank", "decoded_token"}}: the
    `top` best ranked 1..top, the prompt token after them (when not among them) with rank None."""
    if logprobs is None:
        return None
    out: list[Optional[dict[str, Any]]] = []
    for position in logprobs:
        if position is None:
            out.append(None)
            continue
        ranked = sorted(position.items(), key=lambda kv: -kv[1])
        out.append({str(t): {"logprob": json_logprob(lp), "rank": i + 1 if i < top else None,
                             "decoded_token": token_text.decoded(t)} for i, (t, lp) in enumerate(ranked)})
    return out


def with_generation_defaults(fields: dict[str, Any], body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`fields` (SamplingParams keywords of `body`) with the checkpoint's `defaults` for each the body
    leaves out; a default max_tokens also caps a length the body left to the server (its context, or
    the route's default), as vLLM does."""
    out = dict(fields)
    for name, value in defaults.items():
        if name == "max_tokens":
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                out[name] = value if out.get(name) is None else min(out[name], value)
        elif body.get(name) is None:
            out[name] = value
    return out
