"""The node's Prometheus metrics, labelled by model.

Counters and histograms are fed per request; gauges (running, waiting, KV usage, prefix
cache) are read from the engines when scraped, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from helexa.node.registry import ModelRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class NodeMetrics:
    """One registry per node process (tests run several apps in one interpreter)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram(
            "helexa_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "helexa_inter_token_latency_seconds",
            "Time between successive generated tokens of one request",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "helexa_prompt_tokens", "Prompt tokens processed", ["model"], registry=reg
        )
        self.generation_tokens = Counter(
            "helexa_generation_tokens", "Tokens generated", ["model"], registry=reg
        )
        self.success = Counter(
            "helexa_request_success",
            "Requests finished, by finish reason",
            ["model", "finished_reason"],
            registry=reg,
        )
        reg.register(_EngineCollector(lambda: registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, get_registry: Callable[[], ModelRegistry]) -> None:
        self._get = get_registry

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        running = GaugeMetricFamily(
            "helexa_requests_running", "Sequences in the engine's running batch", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "helexa_requests_waiting",
            "Requests waiting: queued for admission or for a place in the running batch",
            labels=["model"],
        )
        kv = GaugeMetricFamily(
            "helexa_kv_cache_usage", "Fraction of KV cache blocks in use (0-1)", labels=["model"]
        )
        queries = CounterMetricFamily(
            "helexa_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            labels=["model"],
        )
        hits = CounterMetricFamily(
            "helexa_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache",
            labels=["model"],
        )
        preemptions = CounterMetricFamily(
            "helexa_preemptions", "Sequences preempted for lack of KV blocks", labels=["model"]
        )
        for served in list(self._get().models.values()):
            s = served.engine.stats()
            label = [served.id]
            running.add_metric(label, s.num_running)
            waiting.add_metric(label, s.num_waiting + served.admission.queue_depth)
            kv.add_metric(label, s.kv_usage)
            queries.add_metric(label, s.prefix_cache_queries)
            hits.add_metric(label, s.prefix_cache_hits)
            preemptions.add_metric(label, s.num_preemptions)
        yield from (running, waiting, kv, queries, hits, preemptions)
