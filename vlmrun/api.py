"""The Python API: `LLM`, `SamplingParams`, `RequestOutput` and the one-call `generate`.

Mirrors vLLM where users expect it. A request whose input is bad fails alone: its
`RequestOutput.error` says why and the other requests of the call still complete. A call that is
interrupted (Ctrl-C, an engine error) aborts its own requests before the exception leaves it, so the
next call starts clean. `LLM` is safe to share between threads: calls run one at a time (a lock),
each to completion.
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from transformers import PreTrainedTokenizerBase

from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.processors.processor import check_continuation
from vlmrun.processors.processor_kwargs import check_processor_kwargs
from vlmrun.config import EngineConfig, mm_limit_fields
from vlmrun.engine.engine import Engine
from vlmrun.engine.outputs import RequestResult
from vlmrun.engine.prompt_forms import parse_prompt
from vlmrun.feed.pipeline import DEFAULT_PREFETCH, Finished, InputPipeline, Work
from vlmrun.feed.progress import FeedProgress
from vlmrun.feed.workers import preprocess_workers as default_preprocess_workers
from vlmrun.lora.request import LoRARequest
from vlmrun.pooling.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, embedding_request_output,
                                    pooling_request_output)
from vlmrun.pooling.params import PoolingParams
from vlmrun.pooling.runner_mode import runner_for
from vlmrun.sampling_params import SamplingParams
from vlmrun.spec_decode.metrics import SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: Optional[float] = None  # sum of the sampled tokens' logprobs; None without logprobs
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it; None for EOS / length

    @classmethod
    def of(cls, index: int, result: RequestResult) -> "CompletionOutput":
        """Choice `index` from the engine's result of it."""
        cumulative = None if result.logprobs is None else sum(
            lp[t] for t, lp in zip(result.token_ids, result.logprobs))
        return cls(index, result.text, result.token_ids, result.logprobs, result.finish_reason,
                   cumulative_logprob=cumulative, stop_reason=result.stop_reason)


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
    # SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (it + the top-k); the first is None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: Optional[RequestMetrics] = None

    def add_completion(self, index: int, result: RequestResult) -> None:
        """Record the engine's result of choice `index` (the prompt fields come from the first one)."""
        self.outputs.append(CompletionOutput.of(index, result))
        self.prompt, self.prompt_token_ids = result.prompt_text, list(result.prompt_token_ids)
        self.prompt_logprobs = result.prompt_logprobs
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
    def logprobs(self) -> Optional[list[dict[int, float]]]:
        return self.outputs[0].logprobs if self.outputs else None

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason if self.outputs else "error"


Conversation = list[dict[str, Any]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
LoRAArg = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]
PoolingArg = Union[PoolingParams, Sequence[PoolingParams], None]


class LLM:
    """An engine for offline use: `generate` and `chat` run a list of requests to completion.

    limit_mm_per_prompt: vLLM's {"image": n, "video": m}, the most items of each a prompt may carry.
    generation_config: where sampling defaults come from (vLLM's): "auto" the checkpoint's
    generation_config.json, "vllm" SamplingParams' own, or a folder holding one.
    quantization: the weights' format, vLLM's names. None reads it from the checkpoint (its
    `quantization_config`: Qwen's block-wise FP8, AWQ or GPTQ int4); "fp8" | "awq" | "gptq" must agree
    with a quantized checkpoint, and "fp8" on a float checkpoint quantizes it at load (online FP8, half
    the weight memory of bf16). Anything unsupported is a ValueError naming it (docs/quantization.md).
    preprocess_workers: threads preprocessing the inputs of a call (None: the CPUs this process may use,
    at most 8); preprocess_prefetch: processed prompts kept ready ahead of the engine (bounds memory).
    runner (vLLM's): "generate" (text) or "pooling" (embeddings: `embed` / `encode`); vLLM's older
    `task="embed"` means runner="pooling". `pooler_config` ({"pooling_type", "normalize"}) overrides the
    checkpoint's pooling (docs/embeddings.md).
    Other keywords are EngineConfig fields (e.g. `fp8_kernel`, `tensor_parallel_size`, `kv_cache_dtype`
    "fp8" for a float8 KV cache, `scheduling_policy` "priority" for `generate`'s `priority`).
    """

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, limit_mm_per_prompt: Optional[dict[str, int]] = None,
                 generation_config: str = "auto", quantization: Optional[str] = None,
                 preprocess_workers: Optional[int] = None, preprocess_prefetch: int = DEFAULT_PREFETCH,
                 runner: str = "generate", task: Optional[str] = None, **engine_kwargs: Any):
        if limit_mm_per_prompt is not None:
            engine_kwargs.update(mm_limit_fields(limit_mm_per_prompt))
        config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              generation_config=generation_config, quantization=quantization,
                              runner=runner_for(runner, task), **engine_kwargs)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one call at a time drives the (single-threaded) engine
        self.preprocess_workers = preprocess_workers or default_preprocess_workers()
        self.preprocess_prefetch = preprocess_prefetch

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (`generation_config`); what a call
        without sampling params uses."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def generate(self, prompts: Union[Any, Iterable[Any]], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True, lora_request: LoRAArg = None, *,
                 priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Each prompt in one of the forms of `vlmrun/engine/prompt_forms.py`, as vLLM takes them: a string
        is the raw prompt (no chat template; `chat` applies it); {"prompt": str, "multi_modal_data":
        {"image": ..., "video": ...}} a raw prompt holding one placeholder per item; {"prompt_token_ids":
        [...]} the same as ids. vlmrun's {"prompt": str, "images": [...], "videos": [...]} is one user turn
        through the chat template.

        `prompts` is one prompt, a list, or any iterable (a generator included): it is read lazily and
        preprocessed by worker threads while the engine steps, at most `preprocess_prefetch` processed
        prompts ahead of it (`vlmrun/feed/`), so memory does not grow with the number of prompts beyond
        the outputs returned. The outputs are in input order.

        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt. A prompt of
        no form raises a ValueError naming the key (for a list, before anything runs); a bad input (an
        unreadable image, a placeholder count that does not match) fails alone (its `error`).

        `lora_request` (vLLM's): a `LoRARequest` for all prompts or a list with one (or None) per prompt;
        the engine needs `enable_lora=True`. A bad adapter fails its requests alone (their `error`).

        `priority` (vLLM's): one int per prompt, with `scheduling_policy="priority"` (lower runs first); a
        non-zero one under "fcfs" is a ValueError before anything runs.
        """
        return _in_input_order(self.generate_stream(prompts, sampling_params, use_tqdm, lora_request,
                                                    priority=priority))

    def generate_stream(self, prompts: Union[Any, Iterable[Any]], sampling_params: ParamsArg = None,
                        use_tqdm: bool = True, lora_request: LoRAArg = None, *,
                        priority: Optional[list[int]] = None) -> Iterator[tuple[int, RequestOutput]]:
        """`generate`, each output handed out as soon as it finishes: `(index, output)`, `index` the
        prompt's position in `prompts`. Holds the LLM (other calls wait) until exhausted or closed;
        leaving the loop early aborts the prompts not yet finished."""
        self.engine.pooling.check_call(pools=False)  # a ValueError on an engine started for embeddings
        inputs, total = _prompt_inputs(prompts)
        if priority is not None:  # vLLM's: a list, one per prompt, checked before anything runs
            if not isinstance(priority, (list, tuple)):
                raise ValueError(f"priority must be a list with one int per prompt, got {type(priority).__name__}")
            for value in priority:
                self.engine.scheduler.policy.check(value)
        return self._stream(inputs, total, sampling_params, use_tqdm, self.engine.process, lora_request,
                            priority)

    def embed(self, prompts: Union[Any, Iterable[Any]], pooling_params: PoolingArg = None, use_tqdm: bool = True,
              lora_request: LoRAArg = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `embed` (an engine started with runner="pooling"): one embedding per prompt, in input order.
        The prompts take `generate`'s forms (images and videos too); `pooling_params` (`dimensions`,
        `normalize`, `truncate_prompt_tokens`) one for all or one per prompt. A bad input fails alone
        (its `error`, an empty embedding); a bad `dimensions` is a ValueError naming it."""
        return self._pool(prompts, pooling_params, use_tqdm, lora_request, embedding_request_output)

    def encode(self, prompts: Union[Any, Iterable[Any]], pooling_params: PoolingArg = None, use_tqdm: bool = True,
               lora_request: LoRAArg = None) -> list[PoolingRequestOutput]:
        """vLLM's `encode`: `embed`'s vectors as `PoolingRequestOutput`s (`.outputs.data`, a float32 tensor)."""
        return self._pool(prompts, pooling_params, use_tqdm, lora_request, pooling_request_output)

    def _pool(self, prompts: Any, pooling_params: Any, use_tqdm: bool, lora_request: LoRAArg,
              convert: Callable[..., Any]) -> list[Any]:
        self.engine.pooling.check_call(pools=True)  # a ValueError on an engine started for generation
        params = pooling_params if pooling_params is not None else PoolingParams()
        for p in params if isinstance(params, (list, tuple)) else [params]:  # each checked before anything runs
            if not isinstance(p, PoolingParams):
                raise ValueError(f"embed / encode take PoolingParams, got {type(p).__name__} (generation options "
                                 f"do not apply to embeddings)")
            p.resolve(self.engine.pooling.config)
        inputs, total = _prompt_inputs(prompts)

        def output(finished: Finished) -> Any:
            return convert(finished.work.request_id, finished.results[0], finished.prompt_token_ids, finished.error)

        return _in_input_order(self._stream(inputs, total, params, use_tqdm, self.engine.process, lora_request,
                                            convert=output))

    def chat(self, messages: Union[Conversation, Iterable[Conversation]],
             sampling_params: ParamsArg = None, use_tqdm: bool = True, *,
             chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict[str, Any]] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[list[dict[str, Any]]] = None,
             mm_processor_kwargs: Optional[dict[str, Any]] = None, lora_request: LoRAArg = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list (or any iterable) of them, each through the chat
        template; streamed into the engine as `generate`'s prompts are, outputs in input order.

        As vLLM's: `chat_template` replaces the checkpoint's (the template or a file path);
        `chat_template_kwargs` are template variables (e.g. {"enable_thinking": False});
        `add_generation_prompt` opens the assistant's reply; `continue_final_message` continues the last
        (assistant) message instead (not both: ValueError); `tools` go to the template;
        `mm_processor_kwargs` ({"min_pixels", "max_pixels", "fps"}) size every image / video that does
        not size itself. `lora_request` as `generate`'s.
        """
        return _in_input_order(self.chat_stream(
            messages, sampling_params, use_tqdm, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, mm_processor_kwargs=mm_processor_kwargs,
            lora_request=lora_request))

    def chat_stream(self, messages: Union[Conversation, Iterable[Conversation]],
                    sampling_params: ParamsArg = None, use_tqdm: bool = True, *,
                    chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict[str, Any]] = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: Optional[list[dict[str, Any]]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None,
                    lora_request: LoRAArg = None) -> Iterator[tuple[int, RequestOutput]]:
        """`chat`, each output handed out as it finishes, as `generate_stream`'s."""
        self.engine.pooling.check_call(pools=False)
        check_continuation(add_generation_prompt, continue_final_message)
        if mm_processor_kwargs is not None:
            check_processor_kwargs(mm_processor_kwargs)
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            messages = [messages]

        def process(conversation: Any) -> ProcessedPrompt:
            return self.engine.processor.process_chat(
                conversation, add_generation_prompt, tools=tools, chat_template_kwargs=chat_template_kwargs,
                chat_template=chat_template, continue_final_message=continue_final_message,
                mm_processor_kwargs=mm_processor_kwargs)

        total = len(messages) if isinstance(messages, Sequence) else None
        return self._stream((list(conv) for conv in messages), total, sampling_params, use_tqdm, process,
                            lora_request)

    def _stream(self, inputs: Iterable[Any], total: Optional[int], params_arg: ParamsArg, use_tqdm: bool,
                process: Callable[[Any], ProcessedPrompt], lora_request: LoRAArg,
                priority: Optional[list[int]] = None,
                convert: Optional[Callable[[Finished], Any]] = None) -> Iterator[tuple[int, Any]]:
        """Check the per-input arguments (now, for a known length), then run (when iterated); each finished
        input becomes `convert(finished)` (default: a RequestOutput)."""
        params = _per_input(params_arg, total, "sampling params", self.get_default_sampling_params())
        loras = _per_input(lora_request, total, "LoRA requests", None)
        priorities = _per_input(priority, total, "priorities", 0)
        return self._run(self._works(inputs, params, loras, priorities), total, use_tqdm, process,
                         convert or _request_output)

    def _works(self, inputs: Iterable[Any], params: Iterator[SamplingParams],
               loras: Iterator[Optional[LoRARequest]], priorities: Iterator[int]) -> Iterator[Work]:
        """The pipeline's inputs, lazily (read by its feeder thread). Lists of params that do not match a
        generator's prompts in number raise a ValueError (at the end of the call)."""
        for item in inputs:
            choice, lora = next(params, None), next(loras, None)
            if choice is None:
                raise ValueError("got fewer sampling params than prompts")
            yield Work(str(next(self._ids)), item, choice.choices(), lora, next(priorities, 0))
        if next(params, None) is not None and not isinstance(params, itertools.repeat):
            raise ValueError("got more sampling params than prompts")

    def _run(self, works: Iterator[Work], total: Optional[int], use_tqdm: bool,
             process: Callable[[Any], ProcessedPrompt],
             convert: Optional[Callable[[Finished], Any]] = None) -> Iterator[tuple[int, Any]]:
        with self._lock:
            pipeline = InputPipeline(self.engine, process, workers=self.preprocess_workers,
                                     prefetch=self.preprocess_prefetch)
            bar = FeedProgress(total, enabled=use_tqdm and total != 1 and total != 0)
            try:
                small = total is not None and total <= self.preprocess_prefetch  # one batch, added at once
                for finished in pipeline.stream(works, whole_batch=small):
                    bar.advance(finished.num_output_tokens, pipeline.preprocessed)
                    yield finished.index, (convert or _request_output)(finished)
            finally:
                bar.close()


def _prompt_inputs(prompts: Any) -> tuple[Iterable[Any], Optional[int]]:
    """The prompts parsed (a list: all now, so a prompt of no form fails before anything runs; any
    other iterable: lazily) and their number (None: unknown)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, Sequence):
        return [parse_prompt(prompt) for prompt in prompts], len(prompts)
    return (parse_prompt(prompt) for prompt in prompts), None


def _request_output(finished: Finished) -> RequestOutput:
    out = RequestOutput(request_id=finished.work.request_id, prompt_token_ids=finished.prompt_token_ids,
                        error=finished.error)
    for index, result in enumerate(finished.results):
        if result is not None:
            out.add_completion(index, result)
    return out


def _in_input_order(stream: Iterator[tuple[int, RequestOutput]]) -> list[RequestOutput]:
    by_index = dict(stream)
    return [by_index[i] for i in range(len(by_index))]


def _per_input(arg: Any, n: Optional[int], what: str, default: Any) -> Iterator[Any]:
    """One value per input: a list of n (n None: checked as the inputs are read), or one value (None:
    `default`) for all."""
    if isinstance(arg, (list, tuple)):
        if n is not None and len(arg) != n:
            raise ValueError(f"got {len(arg)} {what} for {n} prompts")
        return iter(arg)
    return itertools.repeat(arg or default)


@functools.lru_cache(maxsize=1)
def _cached_llm(model: Optional[str], dtype: str, device: str, image_backend: str) -> LLM:
    return LLM(model, dtype=dtype, device=device, image_backend=image_backend)


def generate(images: Any = None, prompt: str = "Describe the image.", *, videos: Any = None,
             model: Optional[str] = None, dtype: str = "auto", device: str = "auto",
             image_backend: str = "auto", max_tokens: int = 256, **sampling: Any) -> str:
    """One request in one call: images and/or videos and a prompt in, text out. The engine is kept for the
    next call.

    `images` is one image (a path, URL, bytes, PIL image, array, image item dict) or a list of them;
    `videos` one video (a path, URL, bytes, array [T, H, W, 3], video item dict such as
    {"video": path, "fps": 1.0} or {"video": [frame, ...]}) or a list of them.
    Other keywords are `SamplingParams` fields, e.g. `structured_outputs={"json": schema}` for text
    that parses as JSON valid under `schema` (a schema that does not compile raises a ValueError)."""
    llm = _cached_llm(model, dtype, device, image_backend)
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling})
    out = llm.generate([{"prompt": prompt, "images": images, "videos": videos}], params, use_tqdm=False)[0]
    if out.error is not None:
        raise InputError(out.error)
    return out.text
