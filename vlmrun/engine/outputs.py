"""What `Engine.step()` hands out: one `RequestUpdate` per request the step touched.

This is the engine's one output shape. `LLM` (`vlmrun/api.py`), the async engine for the server
(`vlmrun/engine/async_engine.py`) and the caption pipeline (`vlmrun/jobs/pipeline.py`) all read
it, and none of them reads the engine's requests: a finished request's update carries its whole
result (`RequestResult`) and the engine forgets the request in the same step.

A request added with `Engine.add_request(..., stream=False)` (the consumer reads only its result: `LLM`
and the jobs, through the feed pipeline; the server's non-streamed requests, through the async engine) gets
two updates: an empty one in the step that collects its
first token (its prefill is over), and its last, with the result (the same result a streamed request
gets). Its text is decoded once, when it finishes (`final_output.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from vlmrun.spec_decode.metrics import SpecDecodeStats


@dataclass(frozen=True)
class RequestResult:
    """A finished request as its consumer needs it; handed out once, by the step that finished it."""

    text: str  # the whole output text, cut at a stop string
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]  # per output token; None unless the request asked for logprobs
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    arrival_time: float  # time.monotonic() when the engine took the request
    first_token_time: Optional[float]  # time.monotonic() of the first output token; None without one
    grammar_ended: bool = False  # structured outputs: the grammar reached an accepting end
    finished_time: float = 0.0  # time.monotonic() when it finished
    scheduled_time: Optional[float] = None  # time.monotonic() when first scheduled; None if never
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it; None for EOS / length
    prompt_text: Optional[str] = None  # the prompt as text (the rendered chat template); None when given as ids
    prompt_token_ids: list[int] = field(default_factory=list)  # as the engine ran it (after truncate_prompt_tokens)
    # per prompt position {token id: raw logprob} (the prompt token + top-k); the first is None; None unless asked
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    spec_decode: Optional[SpecDecodeStats] = None  # speculative decoding's counters; None when the engine does not speculate
    pooled: Optional[torch.Tensor] = None  # a pooling request's embedding [dim] float32 (CPU); None for generation
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's num_cached_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestUpdate:
    """What one step produced for one request: its new tokens and text (streaming), and on its last
    update (`finished`) the request's `result`. A request that does not stream gets empty tokens and text
    (module docstring)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    text_delta: str = ""
    result: Optional[RequestResult] = None  # set exactly when the request finished in this step

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def finish_reason(self) -> Optional[str]:
        return None if self.result is None else self.result.finish_reason
