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
from vlmrun.feed.pipeline import DEFAULT_PREFETCH, InputPipeline, Work
from vlmrun.feed.progress import FeedProgress
from vlmrun.feed.workers import preprocess_workers as default_preprocess_workers
from vlmrun.llm_metrics import LLMStats, Metric
from vlmrun.llm_options import engine_kwargs as vllm_engine_kwargs
from vlmrun.logprobs import TokenDecoder
from vlmrun.lora.request import LoRARequest
from vlmrun.request_output import CompletionOutput, RequestMetrics, RequestOutput, request_output
from vlmrun.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "BeamSearchParams",
           "BeamSearchOutput", "generate"]
logger = logging.getLogger(__name__)


Conversation = list[dict[str, Any]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
LoRAArg = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]


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
    Other keywords are EngineConfig fields (e.g. `fp8_kernel`, `tensor_parallel_size`, `seed`,
    `enforce_eager`, `gpu_memory_utilization`, `mm_processor_kwargs`) or vLLM's other `LLM` keywords
    (`trust_remote_code`, `tokenizer`, `disable_log_stats`, `swap_space`, ...): each honoured, accepted
    with a log line saying it changes nothing here, or refused saying why (`vlmrun/llm_options.py`).
    """

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, limit_mm_per_prompt: Optional[dict[str, int]] = None,
                 generation_config: str = "auto", quantization: Optional[str] = None,
                 preprocess_workers: Optional[int] = None, preprocess_prefetch: int = DEFAULT_PREFETCH,
                 **engine_kwargs: Any):
        if limit_mm_per_prompt is not None:
            engine_kwargs.update(mm_limit_fields(limit_mm_per_prompt))
        engine_kwargs = vllm_engine_kwargs(model, engine_kwargs.get("revision"), engine_kwargs,
                                           {f.name for f in dataclasses.fields(EngineConfig)})
        config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              generation_config=generation_config, quantization=quantization, **engine_kwargs)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one call at a time drives the (single-threaded) engine
        self.preprocess_workers = preprocess_workers or default_preprocess_workers()
        self.preprocess_prefetch = preprocess_prefetch
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
        inputs, total = _prompt_inputs(prompts)
        pairs = list(zip(inputs, _per_input(lora_request, total, "LoRA requests", None)))
        step = concurrency_limit or max(len(pairs), 1)
        outputs = [out for start in range(0, len(pairs), step) for out in self._beam_search(pairs[start:start + step],
                                                                                            params)]
        _warn_failed("beam_search", [(i, out.error) for i, out in enumerate(outputs) if out.error],
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
            outs = _in_input_order(self._stream([p for p, _ in batch], len(batch), round_params, use_tqdm=False,
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

        `mm_processor_kwargs` ({"min_pixels", "max_pixels", "fps"}, as `chat`'s): options for every image
        / video of the call; a prompt's own "mm_processor_kwargs" and an item's own sizing win over them.
        """
        return _in_input_order(self.generate_stream(prompts, sampling_params, use_tqdm, lora_request,
                                                    mm_processor_kwargs=mm_processor_kwargs))

    def generate_stream(self, prompts: Union[Any, Iterable[Any]], sampling_params: ParamsArg = None,
                        use_tqdm: bool = True, lora_request: LoRAArg = None, *,
                        mm_processor_kwargs: Optional[dict[str, Any]] = None) -> Iterator[tuple[int, RequestOutput]]:
        """`generate`, each output handed out as soon as it finishes: `(index, output)`, `index` the
        prompt's position in `prompts`. Holds the LLM (other calls wait) until exhausted or closed;
        leaving the loop early aborts the prompts not yet finished."""
        inputs, total = _prompt_inputs(prompts)
        return self._stream(inputs, total, sampling_params, use_tqdm, self._processing(mm_processor_kwargs),
                            lora_request)

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
                            lora_request, call="chat")

    def _stream(self, inputs: Iterable[Any], total: Optional[int], params_arg: ParamsArg, use_tqdm: bool,
                process: Callable[[Any], ProcessedPrompt], lora_request: LoRAArg,
                call: Optional[str] = "generate") -> Iterator[tuple[int, RequestOutput]]:
        """Check the per-input arguments (now, for a known length), then run (when iterated). `call` names
        the LLM method in the warning about failed inputs (None: no warning)."""
        params = _per_input(params_arg, total, "sampling params", self.get_default_sampling_params())
        loras = _per_input(lora_request, total, "LoRA requests", None)
        return self._run(self._works(inputs, params, loras), total, use_tqdm, process, call)

    def _works(self, inputs: Iterable[Any], params: Iterator[SamplingParams],
               loras: Iterator[Optional[LoRARequest]]) -> Iterator[Work]:
        """The pipeline's inputs, lazily (read by its feeder thread). Lists of params that do not match a
        generator's prompts in number raise a ValueError (at the end of the call)."""
        for item in inputs:
            choice, lora = next(params, None), next(loras, None)
            if choice is None:
                raise ValueError("got fewer sampling params than prompts")
            yield Work(str(next(self._ids)), item, choice.choices(), lora)
        if next(params, None) is not None and not isinstance(params, itertools.repeat):
            raise ValueError("got more sampling params than prompts")

    def _run(self, works: Iterator[Work], total: Optional[int], use_tqdm: bool,
             process: Callable[[Any], ProcessedPrompt], call: Optional[str]) -> Iterator[tuple[int, RequestOutput]]:
        with self._lock:
            pipeline = InputPipeline(self.engine, process, workers=self.preprocess_workers,
                                     prefetch=self.preprocess_prefetch)
            bar = FeedProgress(total, enabled=use_tqdm and total != 1 and total != 0)
            decode, failed = TokenDecoder(self.tokenizer), []
            try:
                small = total is not None and total <= self.preprocess_prefetch  # one batch, added at once
                for finished in pipeline.stream(works, whole_batch=small):
                    bar.advance(finished.num_output_tokens, pipeline.preprocessed)
                    for result in finished.results:
                        if result is not None:
                            self.stats.record(result)
                    if finished.error is not None:
                        failed.append((finished.index, finished.error))
                    yield finished.index, request_output(finished, decode)
            finally:
                bar.close()
                if call is not None:
                    _warn_failed(call, failed)


def _prompt_inputs(prompts: Any) -> tuple[Iterable[Any], Optional[int]]:
    """The prompts parsed (a list: all now, so a prompt of no form fails before anything runs; any
    other iterable: lazily) and their number (None: unknown)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, Sequence):
        return [parse_prompt(prompt) for prompt in prompts], len(prompts)
    return (parse_prompt(prompt) for prompt in prompts), None


def _warn_failed(call: str, failed: list[tuple[int, str]], empty: str = "outputs=[]", shown: int = 3) -> None:
    """One warning naming a call's failed inputs (index and error, the first `shown`) and their count;
    `empty` says what their output holds."""
    if not failed:
        return
    failed = sorted(failed)
    named = "; ".join(f"input {index}: {error}" for index, error in failed[:shown])
    more = f"; and {len(failed) - shown} more" if len(failed) > shown else ""
    logger.warning("LLM.%s: %d input(s) failed; their output has %s and .error set (%s%s). vLLM would raise; "
                   "vlmrun kept the other inputs' outputs.", call, len(failed), empty, named, more)


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
