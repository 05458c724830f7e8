"""vLLM's request fields of a chat or completions body beyond OpenAI's, and what they add to a response.

Sampling (`SamplingParams` arguments): `prompt_logprobs` (the logprob and top-k of every prompt token
after the first), `truncate_prompt_tokens` (keep the last k prompt tokens; -1: max_model_len),
`spaces_between_special_tokens`.

Response (`OutputExtras`, collected answers): `prompt_logprobs` as vLLM writes them (a list with None
first, then {"token id": {"logprob", "rank", "decoded_token"}} per prompt token; rank only where the
token is among the top-k, else null) — for chat on the response, for completions on each choice; with
`return_token_ids` the prompt's ids (`prompt_token_ids`) and each choice's `token_ids`, in the same
places. Streamed, these two are refused with a 400 naming the field.

Defaults (vLLM's `--generation-config`): a sampling field the body leaves out takes the checkpoint's
`generation_config.json` value (`with_generation_defaults`; read once, `ModelConfig.sampling_defaults`).

Refused with a 400 naming the field, never ignored: `stream_options.continuous_usage_stats`; chat
`best_of` other than `n`, `echo`, a per-request `chat_template`, `continue_final_message` and
`mm_processor_kwargs` (the server renders with the model's template, as it was started).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vlmrun.server.errors import bad_request
from vlmrun.server.responses import ChoiceState, TokenText

_CHAT_REFUSED = (  # (field, a value that asks for nothing, why it is refused)
    ("echo", False, "'echo' is not supported on chat completions"),
    ("chat_template", None, "a per-request 'chat_template' is not supported: the server uses the model's "
                            "(or the one it was started with, --chat-template)"),
    ("continue_final_message", False, "'continue_final_message' is not supported by this server"),
    ("mm_processor_kwargs", None, "per-request 'mm_processor_kwargs' are not supported by this server"),
)


def vllm_sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The `SamplingParams` arguments of vLLM's fields (None / True where absent); SamplingParams checks them."""
    spaces = body.get("spaces_between_special_tokens")
    return dict(prompt_logprobs=body.get("prompt_logprobs"), truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
                spaces_between_special_tokens=True if spaces is None else spaces)


def vllm_output_extras(body: dict[str, Any], chat: bool) -> "OutputExtras":
    """What the body's vLLM fields add to the response; 400 naming a field this server does not act on."""
    _refuse_ignored_fields(body, chat)
    return OutputExtras.of(body, stream=body.get("stream") is True)


def _refuse_ignored_fields(body: dict[str, Any], chat: bool) -> None:
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        raise bad_request("'stream_options.continuous_usage_stats' is not supported: usage comes in the last chunk "
                          "('include_usage')", param="stream_options")
    if not chat:
        return
    for name, neutral, why in _CHAT_REFUSED:
        value = body.get(name)
        if value is not None and value != neutral and value != {}:
            raise bad_request(why, param=name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request("'best_of' other than 'n' is not supported", param="best_of")


@dataclass(frozen=True)
class OutputExtras:
    """What vLLM's fields add to a collected response."""

    prompt_logprobs: Optional[int] = None  # the top-k asked for, None when not asked
    return_token_ids: bool = False

    @classmethod
    def of(cls, body: dict[str, Any], stream: bool) -> "OutputExtras":
        return_ids = body.get("return_token_ids")
        if return_ids is not None and not isinstance(return_ids, bool):
            raise bad_request("'return_token_ids' must be true or false", param="return_token_ids")
        extras = cls(body.get("prompt_logprobs"), bool(return_ids))  # its type: checked by SamplingParams
        for name, asked in (("prompt_logprobs", extras.prompt_logprobs is not None),
                            ("return_token_ids", extras.return_token_ids)):
            if asked and stream:
                raise bad_request(f"'{name}' is supported on collected answers only (stream: false)", param=name)
        return extras

    def add_to(self, response: dict[str, Any], choices: list[ChoiceState], token_text: TokenText, chat: bool) -> None:
        """Write the prompt's fields (on the response for chat, on each choice for completions) and each
        choice's token ids into `response`, in place."""
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
        out.append({str(t): {"logprob": max(lp, -9999.0), "rank": i + 1 if i < top else None,
                             "decoded_token": token_text(t)} for i, (t, lp) in enumerate(ranked)})
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
