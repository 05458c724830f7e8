"""The Python API: `LLM`, `SamplingParams`, `RequestOutput` and the one-call `generate`.

Mirrors vLLM where users expect it. A request whose input is bad fails alone: its
`RequestOutput.error` says why and the other requests of the call still complete. A call that is
interrupted (Ctrl-C, an engine error) aborts its own requests before the exception leaves it, so the
next call starts clean. `LLM` is safe to share between threads: calls run one at a time (a lock),
each to completion.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from transformers import PreTrainedTokenizerBase

from vlmrun.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from vlmrun.processors import InputError, ProcessedPrompt
from vlmrun.processors.processor import check_continuation
from vlmrun.processors.processor_kwargs import check_processor_kwargs
from vlmrun.config import EngineConfig, mm_limit_fields
from vlmrun.engine.engine import Engine
from vlmrun.engine.prompt_forms import UserTurnPrompt, parse_prompt, with_processor_kwargs
from vlmrun.feed.pipeline import DEFAULT_PREFETCH, Finished, InputPipeline, Work
from vlmrun.feed.progress import FeedProgress
from vlmrun.feed.prepare import ChatPrepare, GeneratePrepare
from vlmrun.feed.process_workers import main_is_guarded
from vlmrun.feed.workers import check_pool, worker_pool
from vlmrun.feed.workers import preprocess_workers as default_preprocess_workers
from vlmrun.llm_calls import in_input_order, per_input, prompt_inputs, warn_failed
from vlmrun.llm_metrics import LLMStats, Metric
from vlmrun.llm_options import engine_kwargs as vllm_engine_kwargs
from vlmrun.logprobs import TokenDecoder
from vlmrun.lora.request import LoRARequest
from vlmrun.pooling.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, embedding_request_output,
                                    pooling_request_output)
from vlmrun.pooling.params import PoolingParams
from vlmrun.pooling.runner_mode import runner_for
from vlmrun.request_output import CompletionOutput, RequestMetrics, RequestOutput, TokenIdTable, request_output
from vlmrun.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "BeamSearchParams",
           "BeamSearchOutput", "generate"]
logger = logging.getLogger(__name__)


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
    at most 8); preprocess_prefetch: processed prompts kept ready ahead of the engine (bounds memory);
    preprocess_pool: "thread", "process" (one spawned process per worker for `generate` / `chat`; a
    script then needs `if __name__ == "__main__":`) or "auto" (processes past 4 workers on calls of 256
    inputs or more, `vlmrun.feed.workers.worker_pool`).
    runner (vLLM's): "generate" (text) or "pooling" (embeddings: `embed` / `encode`); vLLM's older
    `task="embed"` means runner="pooling". `pooler_config` ({"pooling_type", "normalize"}) overrides the
    checkpoint's pooling (docs/guide/embeddings.md).
    Other keywords are EngineConfig fields (e.g. `fp8_kernel`, `tensor_parallel_size`, `seed`,
    `enforce_eager`, `gpu_memory_utilization`, `mm_processor_kwargs`, `kv_cache_dtype` "fp8" for a float8
    KV cache, `scheduling_policy` "priority" for `generate`'s `priority`) or vLLM's other `LLM` keywords
    (`trust_remote_code`, `tokenizer`, `disable_log_stats`, `swap_space`, ...): each honoured, accepted
    with a log line saying it changes nothing here, or refused saying why (`vlmrun/llm_options.py`).
    """

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, limit_mm_per_prompt: Optional[dict[str, int]] = None,
                 generation_config: str = "auto", quantization: Optional[str] = None,
                 preprocess_workers: Optional[int] = None, preprocess_prefetch: int = DEFAULT_PREFETCH,
                 preprocess_pool: str = "auto", runner: str = "generate", task: Optional[str] = None,
                 **engine_kwargs: Any):
        if limit_mm_per_prompt is not None:
            engine_kwargs.update(mm_limit_fields(limit_mm_per_prompt))
        engine_kwargs = vllm_engine_kwargs(model, engine_kwargs.get("revision"), engine_kwargs,
                                           {f.name for f in dataclasses.fields(EngineConfig)})
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
        self.preprocess_pool = check_pool(preprocess_pool)
        self.stats = LLMStats()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt page (the next prompts compute their KV afresh). False, and
        nothing done, while requests run (another thread's call); True otherwise (also without a cache)."""
        with self._lock:
            if self.engine.has_unfinished():
                return False
            if self.engine.prefix_cache is not None:
                self.engine.prefix_cache.reset()
            return True

    def get_metrics(self) -> list[Metric]:
        """vLLM's metric snapshot (`vlmrun/llm_metrics.py`): `vllm:*` counters, gauges and histograms of
        the engine now and of this LLM's finished requests (unlike vLLM, also with disable_log_stats)."""
        return self.stats.snapshot(self.engine.stats(), str(self.engine.config.model or self.engine.model_config.path))

    def beam_search(self, prompts: Union[Any, Sequence[Any]], params: BeamSearchParams,
                    lora_request: LoRAArg = None, use_tqdm: bool = False,
                    concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (`vlmrun/beam_search.py`): each prompt (any `generate` form) searched with
        `params`, one engine round per output token; per prompt a `BeamSearchOutput`, its best
        `beam_width` sequences first. A prompt whose input is bad has no sequences and an `error`.
        `concurrency_limit` (vLLM's): search at most that many prompts at a time (None: all at once);
        `use_tqdm` is accepted and shows nothing (a round is one short engine call)."""
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(
                concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        inputs, total = prompt_inputs(prompts)
        pairs = list(zip(inputs, per_input(lora_request, total, "LoRA requests", None)))
        step = concurrency_limit or max(len(pairs), 1)
        outputs = [out for start in range(0, len(pairs), step) for out in self._beam_search(pairs[start:start + step],
                                                                                            params)]
        warn_failed("beam_search", [(i, out.error) for i, out in enumerate(outputs) if out.error],
                     empty="sequences=[]")
        return outputs

    def _beam_search(self, pairs: list[tuple[Any, Optional[LoRARequest]]],
                     params: BeamSearchParams) -> list[BeamSearchOutput]:
        """One search over `pairs` (prompt, LoRA request): the prompts processed, then a round per token."""
        search = BeamSearch(params, self.tokenizer)
        for prompt, lora in pairs:
            try:
                search.start(self.engine.process(prompt), lora)
            except ValueError as exc:  # InputError and PromptFormError are ValueErrors
                search.start(None, error=str(exc))
        round_params = params.round_params()
        while not search.done:
            batch = search.round_prompts()
            outs = in_input_order(self._stream([p for p, _ in batch], len(batch), round_params, use_tqdm=False,
                                                process=self.engine.process,
                                                lora_request=[lora for _, lora in batch], call=None))
            search.advance([o.outputs[0].logprobs[0] if o.outputs and o.outputs[0].logprobs else None for o in outs])
        return search.outputs()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (`generation_config`); what a call
        without sampling params uses."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def generate(self, prompts: Union[Any, Iterable[Any]], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True, lora_request: LoRAArg = None, *,
                 priority: Optional[list[int]] = None,
                 mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
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
        Failed inputs are also named in one warning per call (vLLM raises instead; vlmrun keeps the others).

        `priority` (vLLM's): one int per prompt, with `scheduling_policy="priority"` (lower runs first); a
        non-zero one under "fcfs" is a ValueError before anything runs.

        `mm_processor_kwargs` ({"min_pixels", "max_pixels", "fps"}, as `chat`'s): options for every image
        / video of the call; a prompt's own "mm_processor_kwargs" and an item's own sizing win over them.
        """
        return in_input_order(self.generate_stream(prompts, sampling_params, use_tqdm, lora_request,
                                                    priority=priority, mm_processor_kwargs=mm_processor_kwargs))

    def generate_stream(self, prompts: Union[Any, Iterable[Any]], sampling_params: ParamsArg = None,
                        use_tqdm: bool = True, lora_request: LoRAArg = None, *,
                        priority: Optional[list[int]] = None,
                        mm_processor_kwargs: Optional[dict[str, Any]] = None) -> Iterator[tuple[int, RequestOutput]]:
        """`generate`, each output handed out as soon as it finishes: `(index, output)`, `index` the
        prompt's position in `prompts`. Holds the LLM (other calls wait) until exhausted or closed;
        leaving the loop early aborts the prompts not yet finished."""
        self.engine.pooling.check_call(pools=False)  # a ValueError on an engine started for embeddings
        inputs, total = prompt_inputs(prompts)
        if priority is not None:  # vLLM's: a list, one per prompt, checked before anything runs
            if not isinstance(priority, (list, tuple)):
                raise ValueError(f"priority must be a list with one int per prompt, got {type(priority).__name__}")
            for value in priority:
                self.engine.scheduler.policy.check(value)
        portable = GeneratePrepare(self.engine.processor, mm_processor_kwargs)
        return self._stream(inputs, total, sampling_params, use_tqdm, self._processing(mm_processor_kwargs),
                            lora_request, priority=priority, portable=portable)

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
        inputs, total = prompt_inputs(prompts)

        def output(finished: Finished) -> Any:
            return convert(finished.work.request_id, finished.results[0], finished.prompt_token_ids, finished.error)

        return in_input_order(self._stream(inputs, total, params, use_tqdm, self.engine.process, lora_request,
                                            call=None, convert=output))

    def _processing(self, mm_processor_kwargs: Optional[dict[str, Any]]) -> Callable[[Any], ProcessedPrompt]:
        """How `generate` processes a prompt: `Engine.process`, with a call's processor options under the
        prompt's own (checked now: an InputError naming a bad option)."""
        if mm_processor_kwargs is None:
            return self.engine.process
        check_processor_kwargs(mm_processor_kwargs)

        def process(prompt: Any) -> ProcessedPrompt:
            parsed = with_processor_kwargs(parse_prompt(prompt), mm_processor_kwargs)
            if isinstance(parsed, UserTurnPrompt):
                return self.engine.processor.process_prompt(parsed.text, parsed.images, videos=parsed.videos,
                                                            mm_processor_kwargs=mm_processor_kwargs)
            if isinstance(parsed, list):  # a chat given to generate
                return self.engine.processor.process_chat(parsed, mm_processor_kwargs=mm_processor_kwargs)
            return self.engine.process(parsed)

        return process

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
        return in_input_order(self.chat_stream(
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

        process = ChatPrepare(self.engine.processor, add_generation_prompt, {
            "tools": tools, "chat_template_kwargs": chat_template_kwargs, "chat_template": chat_template,
            "continue_final_message": continue_final_message, "mm_processor_kwargs": mm_processor_kwargs})
        total = len(messages) if isinstance(messages, Sequence) else None
        return self._stream((list(conv) for conv in messages), total, sampling_params, use_tqdm, process,
                            lora_request, call="chat", portable=process)

    def _stream(self, inputs: Iterable[Any], total: Optional[int], params_arg: ParamsArg, use_tqdm: bool,
                process: Callable[[Any], ProcessedPrompt], lora_request: LoRAArg,
                priority: Optional[list[int]] = None, call: Optional[str] = "generate",
                convert: Optional[Callable[[Finished], Any]] = None,
                portable: Optional[Callable[[Any], ProcessedPrompt]] = None) -> Iterator[tuple[int, Any]]:
        """Check the per-input arguments (now, for a known length), then run (when iterated); each finished
        input becomes `convert(finished)` (default: a RequestOutput). `call` names the LLM method in the
        warning about failed inputs (None: no warning). `portable`: `process` as a picklable object, for
        worker processes (None: threads only)."""
        params = per_input(params_arg, total, "sampling params", self.get_default_sampling_params())
        loras = per_input(lora_request, total, "LoRA requests", None)
        priorities = per_input(priority, total, "priorities", 0)
        return self._run(self._works(inputs, params, loras, priorities), total, use_tqdm, process, call, convert,
                         portable)

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
             process: Callable[[Any], ProcessedPrompt], call: Optional[str],
             convert: Optional[Callable[[Finished], Any]] = None,
             portable: Optional[Callable[[Any], ProcessedPrompt]] = None) -> Iterator[tuple[int, Any]]:
        with self._lock:
            portable = portable if self.engine.processor.device.type == "cpu" else None  # GPU preprocessing: here
            pool = worker_pool(self.preprocess_pool, self.preprocess_workers, total, portable is not None,
                               main_guarded=self.preprocess_pool != "auto" or main_is_guarded())
            pipeline = InputPipeline(self.engine, process, workers=self.preprocess_workers,
                                     prefetch=self.preprocess_prefetch, pool=pool, portable=portable)
            bar = FeedProgress(total, enabled=use_tqdm and total != 1 and total != 0)
            decode, ids, failed = TokenDecoder(self.tokenizer), TokenIdTable(), []
            try:
                small = total is not None and total <= self.preprocess_prefetch  # one batch, added at once
                for finished in pipeline.stream(works, whole_batch=small):
                    bar.advance(finished.num_output_tokens, pipeline.preprocessed)
                    for result in finished.results:
                        if result is not None and result.pooled is None:
                            self.stats.record(result)
                    if finished.error is not None:
                        failed.append((finished.index, finished.error))
                    out = request_output(finished, decode, ids) if convert is None else convert(finished)
                    yield finished.index, out
            finally:
                bar.close()
                if call is not None:
                    warn_failed(call, failed)


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
