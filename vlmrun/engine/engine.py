"""The engine: takes requests, runs scheduler steps on the model runner, turns tokens into text.

`add_request` validates and queues a processed prompt; `step` runs one scheduler step and returns
what each touched request produced (`engine/outputs.py`: new tokens and text, and for a request that
finished its whole result; the engine forgets a finished request in the step that finished it;
`stream=False`: only an empty update with its first token, and its last, the text decoded then);
`abort` drops a request and frees its memory. The engine is
synchronous and single-threaded; the async wrapper for the server drives it from one loop, `LLM`
under a lock. A step is all or nothing: one that raises aborts its requests (`_drop_interrupted`).

Structured outputs: `add_request` compiles the request's grammar (cached by its text; a bad one
raises `StructuredOutputError`, a ValueError, before anything is queued) and gives the request a
matcher; the sampler masks its logits row with it; `Request.advance_grammar` feeds it every sampled
token and ends the request when the grammar has terminated. A preempted request keeps its output
tokens (it recomputes them, it does not resample them), so its matcher needs no rollback.
`compile_structured` is the one method other threads may call (the server compiles off the
engine thread so that add_request finds the grammar cached).

Reasoning: a request whose constraint holds only after its reasoning
(`structured_outputs.after_reasoning`) or with a `thinking_token_budget` gets a
`vlmrun.structured.reasoning.ReasoningGate` in front of its matcher, placed by the end of its
prompt text: while it reasons the sampler gets no mask and the matcher sees no token.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from vlmrun.processors import InputError, ProcessedPrompt, Processor, ProcessorLimits
from vlmrun.processors.device_plan import choose_preprocess_device
from vlmrun.cache.prefix_cache import PrefixCache, PrefixCacheStats, prompt_page_keys
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.default_model import resolve_model
from vlmrun.engine.output_processor import OutputProcessor
from vlmrun.engine.outputs import RequestUpdate
from vlmrun.engine.prompt_truncation import truncate_prompt
from vlmrun.engine.prompt_forms import RawPrompt, UserTurnPrompt, parse_prompt
from vlmrun.engine.request import Request, RequestStatus
from vlmrun.engine.scheduled_chunk import ScheduledDecodes
from vlmrun.engine.stats import EngineStats
from vlmrun.engine.scheduler import ScheduledChunk, Scheduler
from vlmrun.engine.startup_heap import freeze_startup_heap
from vlmrun.engine.token_timing import TokenTiming, UnusedTokenTiming
from vlmrun.executor.build import build_local_executor
from vlmrun.executor.distributed import create_parallel_executor, executor_device
from vlmrun.executor.base import Executor
from vlmrun.executor.step_output import DecodedRows, SampledToken
from vlmrun.loader import resolve_model_path
from vlmrun.lora.request import LoRARequest, cache_salt
from vlmrun.models import load_model
from vlmrun.models.registry import prompt_positions
from vlmrun.pooling.runner_mode import PoolingMode
from vlmrun.sampling_params import SamplingParams, StopLimits
from vlmrun.spec_decode.proposer import build_proposer
from vlmrun.structured.compiler import GrammarCompiler, GrammarState
from vlmrun.structured.reasoning import ReasoningGate, ReasoningMarkers

logger = logging.getLogger(__name__)


@dataclass
class LaunchedChunks:
    """A launched step: its chunks and plain decodes, and the executor's handle to collect it by."""

    chunks: list[ScheduledChunk]
    handle: Any
    collected: bool = False
    decodes: Optional[ScheduledDecodes] = None


class Engine:
    def __init__(self, config: EngineConfig):
        self.device = executor_device(config)
        config = dataclasses.replace(config, async_scheduling=config.overlaps_steps(self.device))
        self.config = config
        path = resolve_model_path(resolve_model(config.model), config.revision)
        self.model_config = ModelConfig.from_path(path, config, self.device)
        self.processor = Processor.from_pretrained(path, limits=self._limits(), image_backend=config.image_backend,
                                                   device=self._preprocess_device(path), chat_template=config.chat_template,
                                                   mm_processor_kwargs=config.mm_processor_kwargs)
        self.tokenizer = self.processor.tokenizer
        self.pooling = PoolingMode.of(config.runner, path, self.model_config.hf_config,  # generate | pooling
                                      self.model_config.text_config.hidden_size, config.pooler_config)
        self.executor: Executor = self._build_executor()
        self.caches = self.executor.caches  # under tensor parallel, stand-ins that record the scheduler's writes
        self.max_model_len = self.caches.plan.max_model_len
        self._log_memory_plan()
        self.prefix_cache = self._make_prefix_cache()
        self.scheduler = Scheduler(self.caches, config.max_num_batched_tokens, prefix_cache=self.prefix_cache,
                                   snapshot_interval=config.prefix_snapshot_interval, proposer=build_proposer(config),
                                   max_loras=config.lora_slots, disable_by_batch_size=config.disable_by_batch_size,
                                   scheduling_policy=config.scheduling_policy,
                                   decode_rows=getattr(self.executor, "takes_decode_rows", False),
                                   overlaps_steps=config.async_scheduling)
        self.stop_limits = StopLimits.of(config)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.text_config.vocab_size, self.model_config.eos_token_ids)
        self.reasoning_markers = ReasoningMarkers.from_tokenizer(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids, self.max_model_len)
        self._in_flight: Optional[LaunchedChunks] = None  # async scheduling: launched, not yet collected
        self.token_timing: Union[TokenTiming, UnusedTokenTiming] = UnusedTokenTiming()  # the server's: a TokenTiming
        freeze_startup_heap()  # (a full GC pass otherwise walks every library object: engine/startup_heap.py)

    def _build_executor(self) -> Executor:
        """One device: the model, its caches and the runner here. Tensor parallel: rank processes (or
        Ray actors), each with its shard."""
        config = self.config
        if config.tensor_parallel_size > 1:  # the ranks run their steps in order: launch/collect are async already
            return create_parallel_executor(config, self.model_config, self.device)
        model = load_model(self.model_config, self.device, fp8_kernel=config.fp8_kernel)
        return build_local_executor(model, config, self.model_config, self.device)

    def shutdown(self) -> None:
        """End the tensor-parallel rank processes (nothing to do on one device)."""
        self.executor.shutdown()

    def _make_prefix_cache(self) -> Optional[PrefixCache]:
        if not self.config.enable_prefix_caching:
            return None
        caches = self.caches
        if caches.gdn_pool is not None and caches.gdn_snapshots is None:
            logger.info("prefix caching is off for this hybrid model: the budget leaves no room for GDN state "
                        "snapshots (set gdn_prefix_snapshots to take some from the cache budget)")
            return None
        return PrefixCache(caches.allocator, caches.gdn_snapshots, needs_snapshots=caches.gdn_pool is not None)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters (all zero when caching is off); `.hit_rate` = hit tokens / looked-up tokens."""
        return dataclasses.replace(self.prefix_cache.stats) if self.prefix_cache is not None else PrefixCacheStats()

    def stats(self) -> EngineStats:
        """Queue lengths, cache occupancy and counters now (the one place that reads the pools for them)."""
        allocator, rows = self.caches.allocator, self.caches.req_to_token
        rows_used = rows.max_reqs - rows.num_free()
        gdn_used = gdn_total = None
        if self.caches.gdn_pool is not None:  # a request's GDN slot is its row + 1 (slot 0 the dummy)
            gdn_used, gdn_total = rows_used, self.caches.gdn_pool.num_slots - 1
        prefix = self.prefix_cache_stats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_pages_used=allocator.num_usable_pages() - allocator.num_free_pages(),
            kv_pages_total=allocator.num_usable_pages(), req_rows_used=rows_used, req_rows_total=rows.max_reqs,
            gdn_slots_used=gdn_used, gdn_slots_total=gdn_total, num_preemptions=self.scheduler.num_preemptions,
            prefix_query_tokens=prefix.query_tokens, prefix_hit_tokens=prefix.hit_tokens,
            weight_bytes=tuple(self.executor.weight_bytes),
            spec_decode=None if self.scheduler.spec_decode is None else self.scheduler.spec_decode.copy())

    def _log_memory_plan(self) -> None:
        """The weights per device (and their format), then the caches the budget left to them holds."""
        quantization = self.model_config.quantization
        logger.info("weights: %s; bytes per device: %s", quantization.describe() if quantization else
                    f"unquantized {self.model_config.dtype}", ", ".join(map(str, self.executor.weight_bytes)))
        plan = self.caches.plan
        if plan.max_num_seqs < self.config.max_num_seqs:
            logger.warning("max_num_seqs lowered from %d to %d: the GDN state of %d bytes per request must fit "
                           "the cache budget (raise kv_cache_memory_bytes or gpu_memory_utilization)",
                           self.config.max_num_seqs, plan.max_num_seqs, plan.gdn_bytes_per_request)
        logger.info("cache: KV %d bytes/token x %d tokens (%d bytes); GDN state %d bytes/request x %d slots "
                    "(%d bytes); max_num_seqs=%d, max_model_len=%d",
                    plan.kv_bytes_per_token, (plan.num_pages - 1) * plan.page_size, plan.kv_bytes,
                    plan.gdn_bytes_per_request, plan.num_gdn_slots, plan.gdn_bytes, plan.max_num_seqs,
                    plan.max_model_len)
        if plan.num_gdn_snapshots:
            logger.info("prefix cache: %d GDN state snapshots (%d bytes)", plan.num_gdn_snapshots,
                        plan.gdn_snapshot_bytes)

    def _preprocess_device(self, path: str) -> torch.device:
        """Where images are resized and normalised ("auto": on the GPU where it wins, `device_plan`)."""
        return choose_preprocess_device(self.config.preprocess_device, self.device, path, self.config.image_backend)

    def _limits(self) -> ProcessorLimits:
        limits = ProcessorLimits(max_images_per_request=self.config.max_images_per_request,
                                 max_videos_per_request=self.config.max_videos_per_request,
                                 max_prompt_tokens=self.model_config.max_model_len - 1)
        optional = ("max_image_pixels", "max_video_frames", "max_video_frames_decoded", "max_video_tokens")
        given = {name: getattr(self.config, name) for name in optional if getattr(self.config, name) is not None}
        return dataclasses.replace(limits, **given)

    # ------------------------------------------------------------------ requests in

    def process(self, prompt: Any) -> ProcessedPrompt:
        """Any prompt form of `prompt_forms.py` (a string is the raw prompt, no chat template) or a
        ProcessedPrompt, tokenized with its media. PromptFormError for a dict of no form; InputError
        for bad input."""
        parsed = parse_prompt(prompt)
        if isinstance(parsed, ProcessedPrompt):
            return parsed
        if isinstance(parsed, RawPrompt):
            text_or_ids = parsed.token_ids if parsed.token_ids is not None else parsed.text
            return dataclasses.replace(self.processor.process_raw(text_or_ids, parsed.images, videos=parsed.videos,
                                       mm_processor_kwargs=parsed.mm_processor_kwargs), cache_salt=parsed.cache_salt)
        if isinstance(parsed, UserTurnPrompt):
            return self.processor.process_prompt(parsed.text, parsed.images, videos=parsed.videos)
        return self.processor.process_chat(parsed)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    lora_request: Optional[LoRARequest] = None, *, priority: int = 0, stream: bool = True) -> None:
        """Validate and queue a request. `stream=False`: its consumer reads only the result (`LLM`, the jobs):
        no per-step update or text but an empty update with its first token (`engine/final_output.py`)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.policy.check(priority)  # SamplingParamError naming "priority" (e.g. non-zero under fcfs)
        params, pooling = self.pooling.admit(params)  # PoolingParams: an embedding request (prefill-only), its state
        if lora_request is not None:  # read and checked now, off the step loop; a ValueError naming a bad one
            if not self.config.enable_lora:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: the engine was started without "
                                 f"enable_lora=True")
            self.executor.add_lora(lora_request)
        self.stop_limits.check(params)  # SamplingParamError (a ValueError) naming stop / stop_token_ids
        params = params.tokenize_bad_words(self.tokenizer)  # once per request: the sampler bans by token ids
        params.check_token_ids(self.model_config.text_config.vocab_size)  # SamplingParamError naming the field
        prompt = truncate_prompt(prompt, params.truncate_prompt_tokens, self.max_model_len)  # a ValueError naming it
        grammar = self._new_grammar_state(params, prompt)  # StructuredOutputError (a ValueError) if it does not compile
        n = len(prompt.token_ids)
        if n == 0:
            raise InputError("the prompt is empty")
        if n >= self.max_model_len:
            raise InputError(f"the prompt has {n} tokens; this engine allows at most {self.max_model_len - 1} "
                             f"(max_model_len={self.max_model_len}, one left for output)")
        if n + 1 > self.scheduler.capacity_tokens:
            raise InputError(f"the prompt has {n} tokens but the KV cache holds only {self.scheduler.capacity_tokens}")
        positions, delta = prompt_positions(self.model_config.hf_config, prompt.token_ids, prompt.mm_items)
        generator = None if params.seed is None else self.executor.make_generator(params.seed)
        req = Request(request_id=request_id, prompt=prompt, sampling_params=params, mrope_positions=positions,
                      mrope_delta=delta, eos_token_ids=self.model_config.eos_token_ids, generator=generator,
                      grammar=grammar, lora=lora_request, priority=priority, pooling=pooling)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * n  # filled per prefill chunk; the first position stays None
        if self.prefix_cache is not None and (pooling is None or not pooling.pooling.reads_prefix):
            req.page_keys = prompt_page_keys(prompt, self.caches.plan.page_size, cache_salt(lora_request))
        self.requests[request_id] = req
        self.outputs.add(req, stream=stream)
        self.scheduler.add(req)

    def compile_structured(self, params: SamplingParams) -> None:
        """Thread-safe: compile (or find cached) the grammar of `params`; StructuredOutputError if bad."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def _new_grammar_state(self, params: SamplingParams,
                           prompt: ProcessedPrompt) -> Union[GrammarState, ReasoningGate, None]:
        spec = params.structured_outputs
        state = None if spec is None else self.grammars.new_state(spec)
        if not params.gates_reasoning:
            return state
        return ReasoningGate.for_prompt(self.reasoning_markers, state, self.grammars.vocab_size,
                                        self.prompt_text(prompt), params.thinking_token_budget)

    def prompt_text(self, prompt: ProcessedPrompt, tail_tokens: int = 16) -> str:
        """The prompt's text (its end decoded from the ids when the prompt came as token ids)."""
        if prompt.text:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids[-tail_tokens:], skip_special_tokens=False)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.token_timing.release(req)
            self.scheduler.finish(req)
            req.finish_reason = "abort"
            self.outputs.drop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestUpdate]:
        """Plan and launch one step, then read the tokens of a launched one: that step itself, or with
        `async_scheduling` the step the previous call launched, which ran while this call planned
        (so the device does not wait for the host's planning and bookkeeping)."""
        updates: list[RequestUpdate] = []
        uncollected = [] if self._in_flight is None else [self._in_flight]
        self._in_flight = None
        try:
            launched = self._launch(updates, uncollected)
            if self.config.async_scheduling and launched is not None:
                self._in_flight = uncollected.pop()
            if uncollected:
                updates += self._collect(uncollected[0])
        except BaseException:
            self._drop_interrupted(uncollected + ([self._in_flight] if self._in_flight is not None else []))
            raise
        return updates

    def _launch(self, updates: list[RequestUpdate], uncollected: list[LaunchedChunks]) -> Optional[LaunchedChunks]:
        """Schedule and launch a step (appended to `uncollected` the moment it is launched)."""
        chunks, decodes, too_long = self.scheduler.schedule()
        updates += [self._finish(req, "length") for req in too_long]
        if not chunks and not decodes:
            return None
        try:
            inputs = [c.to_input() for c in chunks]
            handle = self.executor.launch(inputs, decodes.to_input()) if decodes else self.executor.launch(inputs)
        except BaseException:
            self._drop_interrupted([LaunchedChunks(chunks, None, collected=True, decodes=decodes)])
            raise
        launched = LaunchedChunks(chunks, handle, decodes=decodes)
        uncollected.append(launched)
        decodes.mark_launched(overlapped=self.config.async_scheduling)
        for c, given in zip(chunks, inputs):  # (the input says what the chunk does: no recount per chunk)
            c.request.mark_launched(given.end, given.sampling is not None, given.num_drafts)
        if inputs:  # their requests move on by other rules than decode rows'
            self.scheduler.decode_table.forget([given.row for given in inputs])
        return launched

    def _collect(self, step: LaunchedChunks) -> list[RequestUpdate]:
        decodes = step.decodes
        if decodes:
            results, decoded = self.executor.collect_step(step.handle)
        else:
            results, decoded = self.executor.collect(step.handle), None
        step.collected = True
        now = time.monotonic()
        updates = [] if decoded is None else self._collect_decodes(decodes, decoded, now)
        for chunk, output in zip(step.chunks, results):
            req, sampled = chunk.request, output.sampled
            req.mark_collected(sampled is not None, len(chunk.draft_token_ids))
            if req.status is RequestStatus.FINISHED:  # finished or aborted while this step ran: its token goes
                continue
            if output.prompt_logprobs is not None:  # a recomputed chunk (after preemption) writes the same values
                req.prompt_logprobs[chunk.start + 1:chunk.start + 1 + len(output.prompt_logprobs)] = output.prompt_logprobs
            end = self.scheduler.settle(chunk, len(output.after_drafts))  # rejected drafts are not computed
            if req.status is RequestStatus.RUNNING and req.page_keys:  # (not when preempted meanwhile: its pages are gone)
                self.scheduler.prefix.commit(req, end)  # index new full pages (and snapshot GDN state) first
            if req.pooling is not None:  # prefill-only: pooled, finished after its last prompt chunk
                updates += self._pooled(req, chunk, output.pooled)
                continue
            if sampled is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                before = self.token_timing.chunk_token(req, now)
                update = self._append_tokens(req, [sampled, *output.after_drafts])
                self.token_timing.chunk_appended(req, before)
                if update is not None:
                    updates.append(update)
        return updates

    def _pooled(self, req: Request, chunk: ScheduledChunk, pooled: Optional[torch.Tensor]) -> list[RequestUpdate]:
        """A pooling request's chunk adds its part; after the last prompt chunk it finishes with its embedding."""
        embedding = req.pooling.add(chunk.start, chunk.end, req.num_prompt_tokens, pooled)
        if embedding is None or req.status is not RequestStatus.RUNNING:  # (preempted meanwhile: it recomputes)
            return []
        update = self._finish(req, "stop")
        update.result = dataclasses.replace(update.result, pooled=embedding)
        return [update]

    def _collect_decodes(self, decodes: ScheduledDecodes, decoded: DecodedRows, now: float) -> list[RequestUpdate]:
        """The plain decodes' tokens, as `_collect` does for a chunk (no drafts, no prompt logprobs): one pass
        over the rows for the bookkeeping, one through the output processor (`append_decodes`). No prefix-cache
        commit: a decode row is past its prompt, whose pages (the only ones indexed) and snapshot points were
        committed when its last prompt chunk was collected (collects run in launch order)."""
        decodes.mark_collected(now, decoded.token_ids)
        self.token_timing.decodes_collected(decodes.host_columns()[0], now)
        updates, finishing = self.outputs.append_decodes(decodes.requests, decoded.token_ids, decoded.logprobs)
        for at, req, reason in finishing:
            updates[at].result = self._finish(req, reason).result
        return updates

    def _drop_interrupted(self, steps: list[LaunchedChunks]) -> None:
        """A step that raised (an error, a KeyboardInterrupt) mid-way may have advanced some layers' GDN
        state in place, or committed some requests and not others: the requests of every launched,
        uncollected step are aborted, so nothing later reads their KV pages, GDN slots or grammar
        state, and no snapshot is taken of them. A step still running is waited for first."""
        self._in_flight, interrupt = None, None
        for step in steps:
            if not step.collected:
                try:
                    self.executor.collect(step.handle)
                except Exception:  # noqa: BLE001 - its requests are dropped either way
                    pass
                except BaseException as exc:  # a Ctrl-C during the wait: every request dropped, then it is raised
                    interrupt = interrupt or exc
            for req in [c.request for c in step.chunks] + ([] if step.decodes is None else step.decodes.requests):
                if self.requests.get(req.request_id) is req:
                    self.abort(req.request_id)
        if interrupt is not None:
            raise interrupt

    def _append_tokens(self, req: Request, tokens: list[SampledToken]) -> Optional[RequestUpdate]:
        """A step's tokens for `req` (engine/output_processor.py); a finishing one's update carries its result
        (None: a request that does not stream, between its first token and its last)."""
        update, finish_reason = self.outputs.append(req, tokens)
        if finish_reason is not None:
            update.result = self._finish(req, finish_reason).result
        return update

    def _finish(self, req: Request, reason: str) -> RequestUpdate:
        """Free the request's memory, forget it, and return its last update (with its result)."""
        self.token_timing.release(req)
        self.scheduler.finish(req)
        req.finish_reason = reason
        del self.requests[req.request_id]
        return RequestUpdate(req.request_id, result=self.outputs.result(req, reason))
