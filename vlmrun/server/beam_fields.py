"""vLLM's `use_beam_search` request fields (/v1/completions, /v1/chat/completions): `beam_search_params`.

As vLLM reads them: `use_beam_search` true asks for beam search; the beam width is `best_of` (when
given) else `n`, and `n` sequences come back best first; `length_penalty`, `ignore_eos`, `temperature`
and `max_tokens` as the body gives them. Streaming it is a 400 (the answer is known only at the end), as
are a `best_of` below `n` and the fields that constrain one sampled sequence (stop strings, structured
outputs, biases...), which the search cannot keep. The search itself: `beam_search_handler.py`.
"""

from __future__ import annotations

from typing import Any, Optional

from vlmrun.beam_search import BeamSearchParams
from vlmrun.sampling_params import SamplingParams
from vlmrun.server.errors import bad_request

# SamplingParams fields that change one sampled sequence: their non-default values cannot hold for beams
_PER_SEQUENCE = ("stop", "stop_token_ids", "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words",
                 "min_tokens", "thinking_token_budget")


def beam_search_params(body: dict[str, Any], params: SamplingParams) -> Optional[BeamSearchParams]:
    """The search a body asks for with `use_beam_search` (None without it); 400 naming a field it cannot take."""
    if body.get("use_beam_search") is not True:
        if body.get("use_beam_search") not in (None, False):
            raise bad_request("'use_beam_search' must be true or false", param="use_beam_search")
        return None
    if body.get("stream") is True:
        raise bad_request("'use_beam_search' with 'stream' is not supported: beam search answers at the end "
                          "(send stream=false)", param="stream")
    width = body.get("best_of") if body.get("best_of") is not None else params.n
    if width < params.n:
        raise bad_request(f"'best_of' ({width}) must be >= 'n' ({params.n}) with beam search", param="best_of")
    for name in _PER_SEQUENCE:
        value = getattr(params, name)
        if value not in (None, [], 0):
            raise bad_request(f"'{name}' is not supported with 'use_beam_search' (it constrains one sampled "
                              "sequence; beam search ranks whole sequences by their logprobs)", param=name)
    length_penalty = body.get("length_penalty", 1.0)
    try:
        return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens or 16, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=length_penalty)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param="best_of" if name == "beam_width" else name) from None
