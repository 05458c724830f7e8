"""What `LLM.generate` / `LLM.chat` return: vLLM's `RequestOutput` and `CompletionOutput`.

Built at the output boundary from the engine's results (`request_output`): the engine's raw logprob
floats become vLLM's `Logprob` objects here (`vlmrun/logprobs.py`), so the step, the server and the
caption job never pay for them. The fields and their meaning follow vLLM's; `error` is vlmrun's (a
request whose input was bad: `outputs` is empty and `error` says why).

Token ids stay vLLM's plain `list[int]` (equality with a list, indexing, slicing, `len`, `json.dumps`,
mutation all as users expect), but the lists of one call share their int objects (`TokenIdTable`):
the tokenizer and the sampler hand out a new int object per token (28 bytes each above 256, on top
of the list's 8-byte slot), so 10,000 outputs of a 1,000-token prompt would hold 280 MB of duplicate
ints; shared, they hold the lists' slots and one int per distinct id. A compact array (`array('q')`,
a tensor) would cost the same 8 bytes a token but is not a list: `json.dumps` refuses it, `==` with
a list is False, and a list made on each access would cost more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from vlmrun.engine.outputs import RequestResult
from vlmrun.feed.pipeline import Finished
from vlmrun.logprobs import Decode, Logprob, cumulative_logprob, prompt_logprobs, sample_logprobs
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import SamplingParams
from vlmrun.spec_decode.metrics import SpecDecodeStats

PositionLogprobs = dict[int, Logprob]


class TokenIdTable:
    """One int object per distinct token id, shared by the token id lists of a call's outputs (the
    module docstring); at most one entry per vocabulary id."""

    def __init__(self) -> None:
        self._ints: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._ints)

    def list_of(self, ids: Iterable[int]) -> list[int]:
        """`list(ids)`, with each id the table's int object."""
        shared = self._ints.setdefault
        return [shared(i, i) for i in ids]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[PositionLogprobs]]  # per output token {token id: Logprob}; None unless asked
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: Optional[float] = None  # sum of the sampled tokens' logprobs; None without logprobs
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it; None for EOS / length
    lora_request: Optional[LoRARequest] = None

    @classmethod
    def of(cls, index: int, result: RequestResult, params: SamplingParams, decode: Decode,
           lora_request: Optional[LoRARequest] = None, ids: Optional[TokenIdTable] = None) -> "CompletionOutput":
        """Choice `index` from the engine's result of it (`params`: the choice's, for its top-k; `ids`: the
        call's shared ints, None to keep the result's list)."""
        token_ids = result.token_ids if ids is None else ids.list_of(result.token_ids)
        return cls(index, result.text, token_ids,
                   sample_logprobs(result.logprobs, result.token_ids, params.logprobs, decode), result.finish_reason,
                   cumulative_logprob=cumulative_logprob(result.logprobs, result.token_ids),
                   stop_reason=result.stop_reason, lora_request=lora_request)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's names, time.monotonic() seconds; over the request's choices (first arrival and token, last
    finish, speculative decoding's counters summed)."""

    arrival_time: float
    first_token_time: Optional[float]  # None: no token was generated
    finished_time: float
    spec_decode: Optional[SpecDecodeStats] = None  # drafts proposed / accepted; None without speculative decoding

    @classmethod
    def of(cls, result: RequestResult) -> "RequestMetrics":
        return cls(result.arrival_time, result.first_token_time, result.finished_time, result.spec_decode)

    def merged(self, other: "RequestMetrics") -> "RequestMetrics":
        """The metrics of two choices of one request as one."""
        first = [t for t in (self.first_token_time, other.first_token_time) if t is not None]
        spec = self.spec_decode if other.spec_decode is None else (
            other.spec_decode if self.spec_decode is None else self.spec_decode.merged(other.spec_decode))
        return RequestMetrics(min(self.arrival_time, other.arrival_time), min(first, default=None),
                              max(self.finished_time, other.finished_time), spec)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: Optional[str] = None
    prompt: Optional[str] = None  # the prompt as text (a chat: its rendered template); None when given as token ids
    # SamplingParams.prompt_logprobs: per prompt token {token id: Logprob} (it + the top-k); the first is None
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the first choice's)
    lora_request: Optional[LoRARequest] = None
    encoder_prompt: Optional[str] = None  # vLLM's encoder-decoder fields: always None (decoder-only models)
    encoder_prompt_token_ids: Optional[list[int]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's disaggregated prefill: always None here
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict)  # vLLM's field: not filled (empty)

    def add_completion(self, index: int, result: RequestResult, params: SamplingParams, decode: Decode,
                       ids: Optional[TokenIdTable] = None) -> None:
        """Record the engine's result of choice `index` (the prompt fields come from the first one; `ids`:
        the call's shared ints)."""
        self.outputs.append(CompletionOutput.of(index, result, params, decode, self.lora_request, ids))
        if len(self.outputs) == 1:
            self.prompt = result.prompt_text
            prompt_ids = result.prompt_token_ids
            self.prompt_token_ids = list(prompt_ids) if ids is None else ids.list_of(prompt_ids)
            self.prompt_logprobs = prompt_logprobs(result.prompt_logprobs, self.prompt_token_ids,
                                                   params.prompt_logprobs, decode)
            self.num_cached_tokens = result.num_cached_tokens
        metrics = RequestMetrics.of(result)
        self.metrics = metrics if self.metrics is None else self.metrics.merged(metrics)

    @property
    def finished(self) -> bool:
        return True

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def logprobs(self) -> Optional[list[PositionLogprobs]]:
        return self.outputs[0].logprobs if self.outputs else None

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason if self.outputs else "error"


def request_output(finished: Finished, decode: Decode, ids: Optional[TokenIdTable] = None) -> RequestOutput:
    """The `RequestOutput` of one finished input (its choices in order; none when its input failed);
    `ids`: the call's shared ints (one table per call)."""
    work = finished.work
    prompt_ids = finished.prompt_token_ids if ids is None else ids.list_of(finished.prompt_token_ids)
    out = RequestOutput(request_id=work.request_id, prompt_token_ids=prompt_ids, error=finished.error,
                        lora_request=work.lora)
    for index, (result, params) in enumerate(zip(finished.results, work.params)):
        if result is not None:
            out.add_completion(index, result, params, decode, ids)
    return out
