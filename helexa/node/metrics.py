"""The node's Prometheus metrics, labelled by model.

Counters and histograms are fed per request; gauges (running, waiting, KV usage, prefix
cache) are read from the engines when scraped, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from helexa.engine import EngineStats
from helexa.node.registry import ModelRegistry
from helexa.node.served import ServedModel

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


# Read from the engines at scrape time: (name, family, help, value of one served model).
_ENGINE_METRICS: tuple[tuple[str, type, str, Callable[[ServedModel, EngineStats], float]], ...] = (
    (
        "helexa_requests_running",
        GaugeMetricFamily,
        "Sequences in the engine's running batch",
        lambda m, s: s.num_running,
    ),
    (
        "helexa_requests_waiting",
        GaugeMetricFamily,
        "Requests waiting: queued for admission or for a place in the running batch",
        lambda m, s: s.num_waiting + m.admission.queue_depth,
    ),
    (
        "helexa_kv_cache_usage",
        GaugeMetricFamily,
        "Fraction of KV cache blocks in use (0-1)",
        lambda m, s: s.kv_usage,
    ),
    (
        "helexa_prefix_cache_queries",
        CounterMetricFamily,
        "Prompt tokens looked up in the prefix cache",
        lambda m, s: s.prefix_cache_queries,
    ),
    (
        "helexa_prefix_cache_hits",
        CounterMetricFamily,
        "Prompt tokens whose KV came from the prefix cache",
        lambda m, s: s.prefix_cache_hits,
    ),
    (
        "helexa_preemptions",
        CounterMetricFamily,
        "Sequences preempted for lack of KV blocks",
        lambda m, s: s.num_preemptions,
    ),
    # speculative decoding, as vLLM names them (0 while it is off)
    (
        "helexa_spec_decode_num_drafts",
        CounterMetricFamily,
        "Drafts checked by speculative decoding (one per speculating row and step)",
        lambda m, s: s.spec_drafts,
    ),
    (
        "helexa_spec_decode_num_draft_tokens",
        CounterMetricFamily,
        "Tokens drafted by speculative decoding",
        lambda m, s: s.spec_draft_tokens,
    ),
    (
        "helexa_spec_decode_num_accepted_tokens",
        CounterMetricFamily,
        "Drafted tokens the model accepted",
        lambda m, s: s.spec_accepted_tokens,
    ),
    (
        "helexa_spec_decode_num_rollbacks",
        CounterMetricFamily,
        "Hybrid models: checks that rejected drafts and rolled the recurrent state back",
        lambda m, s: s.spec_rollbacks,
    ),
    (
        "helexa_spec_decode_num_recomputed_tokens",
        CounterMetricFamily,
        "Hybrid models: tokens fed again after a rollback",
        lambda m, s: s.spec_recomputed_tokens,
    ),
)


class _EngineCollector(Collector):
    def __init__(self, get_registry: Callable[[], ModelRegistry]) -> None:
        self._get = get_registry

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        families = [
            (kind(name, text, labels=["model"]), value)
            for name, kind, text, value in _ENGINE_METRICS
        ]
        for served in list(self._get().models.values()):
            stats = served.stats
            for family, value in families:
                family.add_metric([served.id], value(served, stats))
        yield from (family for family, _ in families)
