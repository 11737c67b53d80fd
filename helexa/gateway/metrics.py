"""The gateway's Prometheus metrics (served on `metrics_listen`, 31314)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from helexa.gateway.fleet import Fleet

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)


class GatewayMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        labels = ["model", "node"]
        self.ttft = Histogram(
            "helexa_time_to_first_token_seconds",
            "Request arrival to the first byte from the node",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.tokens_per_second = Histogram(
            "helexa_tokens_per_second",
            "Completion tokens over the decode window (first to last byte)",
            labels,
            buckets=_TPS_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "helexa_prompt_tokens", "Prompt tokens, from the node's usage", labels, registry=reg
        )
        self.completion_tokens = Counter(
            "helexa_completion_tokens",
            "Completion tokens, from the node's usage",
            labels,
            registry=reg,
        )
        self.spend_tokens = Counter(
            "helexa_spend_tokens",
            "Tokens (prompt + completion) spent by each key",
            ["account", "key"],
            registry=reg,
        )
        self.requests = Counter(
            "helexa_requests", "Requests by route and status code", ["route", "code"], registry=reg
        )
        reg.register(_FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterable[GaugeMetricFamily]:
        up = GaugeMetricFamily("helexa_node_up", "1 while the node answers polls", labels=["node"])
        for node in self.fleet.nodes.values():
            up.add_metric([node.name], 1.0 if node.up else 0.0)
        yield up
