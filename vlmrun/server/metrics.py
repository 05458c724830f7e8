"""Prometheus metrics of one server, in its own registry (no process-global collectors).

Counters and histograms are updated by the handlers on the event loop, once per choice (its first token,
its end: `submission.RequestTracker`); the gauges (queue depth, running requests, KV and GDN pool use) and
the counters the engine keeps per step (generated tokens, `engine/token_timing.py`; steps; preemptions) are
read at scrape time from the engine thread's latest `AsyncEngineStats` snapshot, plus the server's own
count of admitted requests. GDN gauges appear only
when the engine has a GDN state pool (hybrid models); the speculative decoding counters (vLLM's
`spec_decode_*` names: verify steps with drafts, draft tokens, accepted tokens, accepted tokens per
draft position) only when the engine speculates. vLLM's `vllm:` series live beside them in the same
registry (`vllm_metrics.py`).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlmrun.engine.async_engine import AsyncEngineStats
from vlmrun.server.vllm_metrics import VllmMetrics
from vlmrun.spec_decode.metrics import SpecDecodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, stats: Callable[[], AsyncEngineStats], pending: Callable[[], int], model: str,
                 max_model_len: int = 32768):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model}
        self._model = model
        self.requests = Counter("vlmrun_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.finished = Counter("vlmrun_request_choices_finished", "Choices finished, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vlmrun_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=self.registry)
        self.ttft = Histogram("vlmrun_time_to_first_token_seconds",
                              "From request arrival to the engine step that brought its first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vlmrun_time_per_output_token_seconds",
                              "Mean time between output tokens of a finished choice (engine step times)",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vlmrun_e2e_request_latency_seconds", "From request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats, pending, labels))
        self.vllm = VllmMetrics(self.registry, model, max_model_len, stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Scrape-time gauges from the engine's stats snapshot."""

    def __init__(self, stats: Callable[[], AsyncEngineStats], pending: Callable[[], int], labels: dict[str, str]):
        self._stats = stats
        self._pending = pending
        self._labels = labels

    def describe(self) -> list[Metric]:
        return []  # families depend on the model (GDN or not); described at collect time

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names = list(self._labels)
        values = list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("vlmrun_num_requests_running", "Engine requests being run (prefill or decode)", s.num_running)
        yield gauge("vlmrun_num_requests_waiting", "Engine requests queued, waiting to run (queue depth)",
                    s.num_waiting)
        yield gauge("vlmrun_num_requests_admitted", "Engine requests admitted by the server (incl. preprocessing)",
                    self._pending())
        yield gauge("vlmrun_kv_cache_usage_ratio", "Share of KV cache pages in use", s.kv_usage)
        yield gauge("vlmrun_kv_cache_pages_used", "KV cache pages in use", s.kv_pages_used)
        yield gauge("vlmrun_kv_cache_pages_total", "KV cache pages usable", s.kv_pages_total)
        if s.gdn_slots_total is not None:
            yield gauge("vlmrun_gdn_pool_usage_ratio", "Share of GDN state slots in use", s.gdn_usage or 0.0)
            yield gauge("vlmrun_gdn_pool_slots_used", "GDN state slots in use", s.gdn_slots_used or 0)
            yield gauge("vlmrun_gdn_pool_slots_total", "GDN state slots usable", s.gdn_slots_total)
        for name, doc, value in (
                ("vlmrun_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", s.prefix_query_tokens),
                ("vlmrun_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache",
                 s.prefix_hit_tokens)):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        generated = CounterMetricFamily("vlmrun_generation_tokens", "Generated tokens", labels=names)
        generated.add_metric(values, s.generation_tokens)
        yield generated
        steps = CounterMetricFamily("vlmrun_engine_steps", "Engine steps run", labels=names)
        steps.add_metric(values, s.num_steps)
        yield steps
        preempt = CounterMetricFamily("vlmrun_num_preemptions", "Requests preempted (recomputed later)",
                                      labels=names)
        preempt.add_metric(values, s.num_preemptions)
        yield preempt
        if s.spec_decode is not None:
            yield from self._spec_decode_counters(s.spec_decode, names, values)

    @staticmethod
    def _spec_decode_counters(spec: SpecDecodeStats, names: list[str], values: list[str]) -> Iterator[Metric]:
        for name, doc, value in (
                ("vlmrun_spec_decode_num_drafts", "Verify steps that fed draft tokens", spec.num_drafts),
                ("vlmrun_spec_decode_num_draft_tokens", "Draft tokens fed to verify steps", spec.num_draft_tokens),
                ("vlmrun_spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        per_pos = CounterMetricFamily("vlmrun_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position (0: the first draft)",
                                      labels=names + ["position"])
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric(values + [str(position)], value)
        yield per_pos
