"""vLLM's `vllm:` Prometheus series, beside vlmrun's own, so that a dashboard built for vLLM finds its data.

Names, types and labels as vLLM's PrometheusStatLogger writes them: every series carries `model_name`
(the first served name) and `engine` ("0": one engine); `vllm:request_success_total` adds
`finished_reason` (stop, length, abort; each present from the start, at 0).

- gauges, read at scrape time from the engine's stats snapshot: `num_requests_running`,
  `num_requests_waiting`, `kv_cache_usage_perc` and its older name `gpu_cache_usage_perc` (a fraction
  in [0, 1], as vLLM's); for the older (V0) dashboards that still query them, `cpu_cache_usage_perc` and
  `num_requests_swapped`, always 0 (no KV is swapped to the host here);
- counters: `prompt_tokens` (a choice's prompt, counted when its first token comes), `request_success`,
  and from the engine `generation_tokens` (per step, `vlmrun.engine.token_timing`), `num_preemptions`,
  `prefix_cache_queries` / `prefix_cache_hits` (in tokens);
- histograms per finished choice (each of a request's `n` choices is one engine request, as in vLLM):
  `time_to_first_token_seconds` (from the request's arrival at the server to the engine's collect of the
  step that brought its first token), `e2e_request_latency_seconds` (to the event loop's receipt of its last
  token), the engine's phases `request_queue_time_seconds` (taken → first scheduled),
  `request_prefill_time_seconds` (first scheduled → first token), `request_decode_time_seconds` (first → last
  token), `request_inference_time_seconds` (first scheduled → last token),
  `request_time_per_output_token_seconds` (decode time / (tokens - 1)), `request_prompt_tokens`,
  `request_generation_tokens`, `request_params_max_tokens`; per request `request_params_n` and
  `request_max_num_generation_tokens`; from the engine (`vlmrun.engine.token_timing`, read at scrape time),
  per request per step that brought it tokens after its first `inter_token_latency_seconds` and its older
  name `time_per_output_token_seconds` (the gap between the engine's collects of its steps), and per engine
  step `iteration_tokens_total`.

Every one is taken the same way for a streamed request and for one that is not (whose choices hand the
event loop only a first-token delta and a last one): nothing here runs per token, and a streamed choice's
deltas between its first and its last only add to its token count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from vlmrun.engine.async_engine import AsyncEngineStats
from vlmrun.engine.request_group import ChoiceDelta
from vlmrun.engine.token_timing import ITL_BUCKETS as _ITL_BUCKETS

LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """The `vllm:` series of one server, in the server's registry."""

    def __init__(self, registry: CollectorRegistry, model: str, max_model_len: int,
                 stats: Callable[[], AsyncEngineStats]):
        self.label_values = (model, "0")
        self.prompt_total = 0  # a plain total, for the periodic statistics log line (generation: the engine's)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*self.label_values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*self.label_values)

        tokens = one_two_five_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        success = Counter("vllm:request_success", "Requests finished, by finish reason",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*self.label_values, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds", _TTFT_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of a finished request in seconds", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds",
                             _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time a request waited to be scheduled in seconds",
                               _REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Time from first scheduled to last token in seconds", _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Time from first scheduled to first token in seconds", _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Time from first to last token in seconds",
                                _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of a request", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens of a request",
                                                   tokens)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Most tokens generated by one choice of a request", tokens)
        self.params_n = histogram("vllm:request_params_n", "The n of a request", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of a request", tokens)
        registry.register(_EngineSeries(stats, self.label_values))

    def request(self, arrival: float, prompt_tokens: list[int], max_tokens: list[Optional[int]],
                n: int) -> "VllmRequestStats":
        """The bookkeeping of one server request: its choices' prompt lengths and max_tokens, its n."""
        return VllmRequestStats(self, arrival, prompt_tokens, max_tokens, n)


@dataclass
class VllmRequestStats:
    """One request's choices as the `vllm:` series count them (event-loop thread only)."""

    metrics: VllmMetrics
    arrival: float
    prompt_tokens: list[int]  # per choice
    max_tokens: list[Optional[int]]  # per choice
    n: int
    _started: set[int] = field(default_factory=set)  # choices whose first token came
    _generated: dict[int, int] = field(default_factory=dict)  # per choice: its tokens so far (all, once finished)
    _closed: bool = False

    def on_batch(self, batch: list[ChoiceDelta], now: Optional[float] = None) -> None:
        """A choice's first-token delta (`first_token_time`): its time to first token and prompt tokens; its
        last: the per-choice histograms. A streamed choice's deltas between add only its token count."""
        now = time.monotonic() if now is None else now
        m = self.metrics
        for d in batch:
            if d.first_token_time is not None and d.index not in self._started:
                self._started.add(d.index)
                m.ttft.observe(max(0.0, d.first_token_time - self.arrival))
                m.prompt_tokens.inc(self.prompt_tokens[d.index])
                m.prompt_total += self.prompt_tokens[d.index]
            if d.finished:
                self._generated[d.index] = max(self._generated.get(d.index, 0), d.num_output_tokens)
                self._finished(d, now)
            elif d.token_ids:
                self._generated[d.index] = self._generated.get(d.index, 0) + len(d.token_ids)

    def _finished(self, d: ChoiceDelta, now: float) -> None:
        m = self.metrics
        m.success.get(d.finish_reason or "abort", m.success["abort"]).inc()
        generated = self._generated.get(d.index, 0)
        m.e2e.observe(now - self.arrival)
        m.request_prompt_tokens.observe(self.prompt_tokens[d.index])
        m.request_generation_tokens.observe(generated)
        if self.max_tokens[d.index] is not None:
            m.params_max_tokens.observe(self.max_tokens[d.index])
        if d.arrival_time is not None and d.scheduled_time is not None:
            m.queue.observe(max(0.0, d.scheduled_time - d.arrival_time))
            if d.finished_time is not None:
                m.inference.observe(max(0.0, d.finished_time - d.scheduled_time))
            if d.first_token_time is not None:
                m.prefill.observe(max(0.0, d.first_token_time - d.scheduled_time))
        if d.first_token_time is not None and d.finished_time is not None:
            decode = max(0.0, d.finished_time - d.first_token_time)
            m.decode.observe(decode)
            if generated > 1:
                m.request_tpot.observe(decode / (generated - 1))

    def close(self) -> None:
        """The request is over: per prompt (its `n` consecutive choices), n and the most tokens one of them
        generated."""
        if self._closed:
            return
        self._closed = True
        for first in range(0, max(1, len(self.prompt_tokens)), self.n):
            self.metrics.params_n.observe(self.n)
            most = max((self._generated.get(i, 0) for i in range(first, first + self.n)), default=0)
            self.metrics.max_generation_tokens.observe(most)


class _EngineSeries:
    """Scrape-time `vllm:` gauges and counters from the engine's stats snapshot."""

    def __init__(self, stats: Callable[[], AsyncEngineStats], label_values: tuple[str, str]):
        self._stats = stats
        self._values = list(label_values)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests being run (prefill or decode)", s.num_running),
                ("vllm:num_requests_waiting", "Requests waiting to run", s.num_waiting),
                ("vllm:kv_cache_usage_perc", "Share of the KV cache in use (1 = full)", s.kv_usage),
                ("vllm:gpu_cache_usage_perc", "Share of the KV cache in use (1 = full; the older name)", s.kv_usage),
                ("vllm:cpu_cache_usage_perc", "Share of a host swap cache in use (none here: 0)", 0.0),
                ("vllm:num_requests_swapped", "Requests swapped to the host (never here: 0)", 0)):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self._values, value)
            yield gauge
        for name, doc, value in (
                ("vllm:generation_tokens", "Generated tokens", s.generation_tokens),
                ("vllm:num_preemptions", "Requests preempted", s.num_preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_query_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_hit_tokens)):
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._values, value)
            yield counter
        for name, doc, histogram in (
                ("vllm:inter_token_latency_seconds", "Time between output tokens in seconds", s.token_gaps),
                ("vllm:time_per_output_token_seconds",
                 "Time between output tokens in seconds (the older name of inter_token_latency)", s.token_gaps),
                ("vllm:iteration_tokens_total", "Tokens per engine step", s.step_tokens)):
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            if histogram is not None:
                family.add_metric(self._values, histogram.cumulative(), histogram.sum)
            yield family
