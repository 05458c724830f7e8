"""`LLM.get_metrics()`: vLLM's metric snapshot (`vllm.v1.metrics.reader`'s shape) for the offline API.

vLLM's offline `LLM.get_metrics()` returns a list of metric objects, each with a `name` (the
Prometheus series, `vllm:...`) and `labels` ({"model_name": ..., "engine": "0"}): `Counter`
(`value`, an int), `Gauge` (`value`, a float) and `Histogram` (`count`, `sum`, `buckets`: upper
bound as a string -> cumulative count, "+Inf" last). `LLMStats` counts what the calls of one `LLM`
finished (tokens, requests by finish reason, latencies); the engine's own counters (queues, KV usage,
prefix-cache lookups, preemptions) are read from `Engine.stats()` at the snapshot.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional, Union

from vlmrun.engine.engine import EngineStats
from vlmrun.engine.outputs import RequestResult

# vLLM's bucket bounds for these histograms (seconds; tokens for the size histograms)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> cumulative count ("+Inf" last)


@dataclass
class Observations:
    """One histogram's samples: per-bucket counts (the last one +Inf) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, running = {}, 0
        for bound, count in zip([*map(_bound_text, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative[bound] = running
        return Histogram(name, labels, count=running, sum=self.total, buckets=cumulative)


@dataclass
class LLMStats:
    """What one `LLM`'s calls finished, counted as the results come in (`record`)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Observations = field(default_factory=lambda: Observations(TTFT_BUCKETS))
    e2e: Observations = field(default_factory=lambda: Observations(E2E_BUCKETS))
    prompt_sizes: Observations = field(default_factory=lambda: Observations(TOKEN_BUCKETS))
    output_sizes: Observations = field(default_factory=lambda: Observations(TOKEN_BUCKETS))

    def record(self, result: RequestResult) -> None:
        """Count one finished engine request (one choice)."""
        self.prompt_tokens += result.num_prompt_tokens
        self.generation_tokens += result.num_output_tokens
        self.finished[result.finish_reason] = self.finished.get(result.finish_reason, 0) + 1
        if result.first_token_time is not None:
            self.ttft.observe(result.first_token_time - result.arrival_time)
        self.e2e.observe(result.finished_time - result.arrival_time)
        self.prompt_sizes.observe(result.num_prompt_tokens)
        self.output_sizes.observe(result.num_output_tokens)

    def snapshot(self, engine: EngineStats, model_name: str) -> list[Union[Counter, Gauge, Histogram]]:
        """vLLM's metric list: the engine's gauges and counters now, then this LLM's counts."""
        labels = {"model_name": model_name, "engine": "0"}
        out: list[Union[Counter, Gauge, Histogram]] = [
            Gauge("vllm:num_requests_running", labels, float(engine.num_running)),
            Gauge("vllm:num_requests_waiting", labels, float(engine.num_waiting)),
            Gauge("vllm:kv_cache_usage_perc", labels, engine.kv_usage),
            Counter("vllm:num_preemptions", labels, engine.num_preemptions),
            Counter("vllm:prefix_cache_queries", labels, engine.prefix_query_tokens),
            Counter("vllm:prefix_cache_hits", labels, engine.prefix_hit_tokens),
            Counter("vllm:prompt_tokens", labels, self.prompt_tokens),
            Counter("vllm:generation_tokens", labels, self.generation_tokens),
        ]
        out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, count)
                for reason, count in self.finished.items()]
        out += [self.ttft.metric("vllm:time_to_first_token_seconds", labels),
                self.e2e.metric("vllm:e2e_request_latency_seconds", labels),
                self.prompt_sizes.metric("vllm:request_prompt_tokens", labels),
                self.output_sizes.metric("vllm:request_generation_tokens", labels)]
        return out


def _bound_text(bound: float) -> str:
    return repr(float(bound))


def find_metric(metrics: list[Metric], name: str, labels: Optional[dict[str, str]] = None) -> Optional[Metric]:
    """The first metric named `name` whose labels include `labels`; None when there is none."""
    for metric in metrics:
        if metric.name == name and all(metric.labels.get(k) == v for k, v in (labels or {}).items()):
            return metric
    return None
