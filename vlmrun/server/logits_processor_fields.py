"""The logits-processor fields of a chat or completions body, as `SamplingParams` arguments.

`logit_bias` (OpenAI's): an object of token ids, as strings of digits, to numbers; each bias is
clamped to [-100, 100], as vLLM's server does, and added to that token's logit. `allowed_token_ids`
(vLLM's): only these tokens may be sampled. `bad_words` (vLLM's): words the output may not contain.
`SamplingParams` checks their shapes (a 400 naming the field); token ids past the vocabulary are
refused, with a 400 naming the field too, when the engine takes the request.
"""

from __future__ import annotations

from typing import Any, Optional

from vlmrun.processors.limits import quote
from vlmrun.server.errors import bad_request

MAX_BIAS = 100.0  # OpenAI's range for a logit_bias value is [-MAX_BIAS, MAX_BIAS]
MAX_TOKEN_ID_DIGITS = 19  # a token id fits an int64


def logits_processor_fields(body: dict[str, Any], vocab_size: Optional[int] = None) -> dict[str, Any]:
    """`logit_bias`, `allowed_token_ids` and `bad_words` of `body` (None where absent). With `vocab_size`,
    a `logit_bias` or `allowed_token_ids` longer than the vocabulary is a 400 before its entries are read,
    and a `logit_bias` id past it a 400 at once (100k entries would cost each other request a second)."""
    allowed = body.get("allowed_token_ids")
    if vocab_size is not None and isinstance(allowed, list) and len(allowed) > vocab_size:
        raise bad_request(f"allowed_token_ids has {len(allowed):,} ids; the vocabulary has {vocab_size:,} tokens",
                          param="allowed_token_ids")
    return dict(logit_bias=_logit_bias(body, vocab_size), allowed_token_ids=allowed, bad_words=body.get("bad_words"))


def _logit_bias(body: dict[str, Any], vocab_size: Optional[int]) -> Optional[dict[int, float]]:
    """{"token id": bias} as {id: clamped bias}; None when absent or empty."""
    bias = body.get("logit_bias")
    what = "'logit_bias' must be an object of token ids (strings of digits) to numbers"
    if bias is not None and not isinstance(bias, dict):
        raise bad_request(what, param="logit_bias")
    if not bias:
        return None
    if vocab_size is not None and len(bias) > vocab_size:
        raise bad_request(f"logit_bias has {len(bias):,} entries; the vocabulary has {vocab_size:,} tokens",
                          param="logit_bias")
    clamped = {}
    for key, value in bias.items():
        is_id = key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS
        if not is_id or not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_request(f"{what}, got {quote(key, 40)}: {quote(value, 40)}", param="logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {token}",
                              param="logit_bias")
        clamped[token] = float(min(MAX_BIAS, max(-MAX_BIAS, value)))
    return clamped
