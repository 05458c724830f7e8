"""What one server instance holds (kept in `app.state.vlmrun`, never in module globals).

`ServerState` bundles the async engine, the settings, the server's own `Processor` (local paths
and URLs off: the `MediaResolver` hands it bytes; its videos bounded by the context too), the thread
pools (media, light, and the `GrammarPool` that compiles output constraints), the metrics, the
admission counter that turns a full queue into 429, and the per-request limits (`max_n`, the engine's
stop-string limits, the constraint sizes, the prompt text that can fit the context) the request
parser applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from vlmrun.processors import Processor
from vlmrun.processors.video_io import video_decoder
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import StopLimits
from vlmrun.server.errors import bad_request, model_not_found, queue_full
from vlmrun.server.media import MediaPolicy, MediaResolver
from vlmrun.server.grammar_pool import GrammarPool
from vlmrun.server.memory import MemoryTrimmer
from vlmrun.server.metrics import ServerMetrics
from vlmrun.server.prompt_bounds import PromptBounds
from vlmrun.server.protocol import RequestLimits
from vlmrun.server.settings import ServerSettings
from vlmrun.structured import GrammarLimits

T = TypeVar("T")


class Admission:
    """Counts engine requests in flight; refuses (429) beyond `limit`, and (400) a request that alone
    asks for more than `limit`: no retry could admit it. Event-loop thread only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.admitted = 0  # requests admitted so far (the memory trimmer's sign of activity)

    def admit(self, n: int) -> "Ticket":
        if n > self.limit:
            raise bad_request(f"the request needs {n:,} engine requests (prompts x n), more than this server "
                              f"ever runs at once ({self.limit:,}); split it", code="too_many_requests_in_one")
        if self.in_flight + n > self.limit:
            raise queue_full(self.limit)
        self.in_flight += n
        self.admitted += 1
        return Ticket(self, n)


@dataclass
class Ticket:
    admission: Admission
    n: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.in_flight -= self.n


# Threads of the light pool; a body over LIGHT_BODY_BYTES is parsed in the media pool.
LIGHT_WORKERS = 2
LIGHT_BODY_BYTES = 256 * 1024
# Threads that fetch media URLs (each waits at most url_timeout_s; they wait, they do not compute).
FETCH_WORKERS = 32
# A request whose images declare more pixels than this in all (a 7,900 x 7,900 PNG decodes to 187 MB and
# takes seconds to resize) is prepared in the bulk pool's thread, so such requests never fill the media pool.
BULK_PIXELS = 16_000_000
BULK_WORKERS = 1


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    processor: Processor
    media: MediaResolver
    media_pool: ThreadPoolExecutor  # large bodies, image and video fetching and preprocessing
    light_pool: ThreadPoolExecutor  # small bodies and text-only requests: never queued behind media work
    metrics: ServerMetrics
    admission: Admission
    limits: RequestLimits
    grammars: GrammarPool  # client constraints compile here, never in the light or media pool
    trimmer: MemoryTrimmer  # hands the memory of large bodies back after them
    fetch_pool: ThreadPoolExecutor  # media URLs and files read: network waits never hold a media thread
    bulk_pool: ThreadPoolExecutor  # requests whose images declare over BULK_PIXELS: never hold the media pool
    created: int = field(default_factory=lambda: int(time.time()))
    bulk_pixels: int = BULK_PIXELS

    @classmethod
    def build(cls, engine: AsyncEngine, settings: ServerSettings) -> "ServerState":
        base = engine.engine.processor
        limits = dataclasses.replace(base.limits, allow_local_paths=False, allow_remote_urls=False,
                                     max_image_bytes=min(settings.max_image_bytes, base.limits.max_image_bytes),
                                     max_video_bytes=min(settings.max_video_bytes, base.limits.max_video_bytes))
        if base.video_processor is not None:  # its libraries load now, not on a client's first video (seconds
            video_decoder()  # under the import lock, and ~190 MB of RSS that would read as that client's)
        processor = Processor(base.tokenizer, base.chat_template, base.image_processor, limits,
                              device=base.device, source=base.source, video_processor=base.video_processor,
                              video_prompt=base.video_prompt, mm_processor_kwargs=base.mm_processor_kwargs)
        media = MediaResolver(MediaPolicy(
            allow_remote_urls=settings.allow_remote_urls, allow_private_urls=settings.allow_private_urls,
            allowed_local_media_path=settings.allowed_local_media_path, url_timeout_s=settings.url_timeout_s,
            max_image_bytes=limits.max_image_bytes, max_video_bytes=limits.max_video_bytes,
            max_redirects=settings.max_url_redirects))
        admission = Admission(engine.engine.config.max_num_seqs + settings.max_queued_requests)
        metrics = ServerMetrics(lambda: engine.stats, lambda: admission.in_flight, settings.served_model_name,
                                engine.engine.max_model_len)
        media_pool = ThreadPoolExecutor(settings.preprocess_workers, thread_name_prefix="vlmrun-media")
        light_pool = ThreadPoolExecutor(LIGHT_WORKERS, thread_name_prefix="vlmrun-light")
        grammar_limits = GrammarLimits(settings.max_grammar_chars, settings.max_grammar_choices)
        sampling_defaults = {**engine.engine.model_config.sampling_defaults, **settings.sampling_overrides()}
        limits = RequestLimits(settings.max_n, StopLimits.of(engine.engine.config),
                               sampling_defaults=sampling_defaults, grammar=grammar_limits,
                               prompt=PromptBounds.of(base.tokenizer, engine.engine.max_model_len),
                               max_logprobs=settings.max_logprobs, tokens_as_ids=settings.return_tokens_as_token_ids,
                               force_include_usage=settings.enable_force_include_usage,
                               vocab_size=engine.engine.model_config.text_config.vocab_size)
        compiler = engine.engine.grammars
        compiler.limit_bytes(settings.grammar_cache_bytes)
        trimmer = MemoryTrimmer(media_pool)
        grammars = GrammarPool(compiler.compile, compiler.is_cached, settings.grammar_workers,
                               settings.max_pending_grammars, settings.grammar_timeout_s, trimmer.schedule)
        fetch_pool = ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="vlmrun-fetch")
        bulk_pool = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="vlmrun-bulk")
        return cls(engine, settings, processor, media, media_pool, light_pool, metrics, admission, limits, grammars,
                   trimmer, fetch_pool, bulk_pool)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    def check_model(self, model: Optional[str]) -> Optional[LoRARequest]:
        """None or a served name: the base model (None); a `--lora-modules` name: that adapter; any other
        name is a 404."""
        if model is None or model in self.settings.served_model_names:
            return None
        if model in self.settings.lora_modules:
            return self.settings.lora_request(model)
        raise model_not_found(model, [*self.settings.served_model_names, *self.settings.lora_modules])

    async def in_pool(self, fn: Callable[[], T], heavy: bool, bulk: bool = False) -> T:
        """Run `fn` off the event loop: in the bulk pool when `bulk`, the media pool when `heavy`, else in the
        light pool."""
        pool = self.bulk_pool if bulk else self.media_pool if heavy else self.light_pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def is_bulk(self, messages: Any) -> bool:
        """Whether the images of `messages` declare more than `bulk_pixels` in all (their headers, read in
        the light pool): such a request is prepared in the bulk pool, behind its likes only."""
        return await self.in_pool(lambda: self.media.declared_pixels(messages) > self.bulk_pixels, heavy=False)

    async def resolve_media(self, messages: Any) -> Any:
        """`messages` with their media URLs fetched and files read (`MediaResolver`), in the fetch pool; the
        same messages when there is nothing to fetch (data URIs are decoded later, in the media pool)."""
        if not self.media.fetches(messages):
            return messages
        return await asyncio.get_running_loop().run_in_executor(self.fetch_pool, self.media.resolve_messages,
                                                                messages)

    def shutdown_pools(self) -> None:
        for pool in (self.media_pool, self.light_pool, self.fetch_pool, self.bulk_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.shutdown()

