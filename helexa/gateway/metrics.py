"""The gateway's Prometheus metrics (served on `metrics_listen`, 31314)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from helexa.gateway.fleet import Fleet

if TYPE_CHECKING:
    from helexa.gateway.budgets import Budgets
    from helexa.gateway.ledger import Ledger

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)


class GatewayMetrics:
    """Every request touches several labelled series: `child` finds each one in a dict
    (prometheus_client's `labels()` takes a lock and checks its values on every call)."""

    def __init__(self, fleet: Fleet) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}
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
        self.unbooked = Counter(
            "helexa_requests_unbooked",
            "Requests sent towards a node that ran no model there (refused before its engine "
            "ran, or never reached it): no ledger row; anonymous ones under empty labels",
            ["account", "key", "code"],
            registry=reg,
        )
        self.requests = Counter(
            "helexa_requests", "Requests by route and status code", ["route", "code"], registry=reg
        )
        reg.register(_FleetCollector(fleet))

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once per distinct series."""
        key = (id(metric), *values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def watch_books(self, ledger: Ledger, budgets: Budgets) -> None:
        """Export the books' writer and this gateway's reservations."""
        self.registry.register(_BooksCollector(ledger, budgets))

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


class _BooksCollector(Collector):
    def __init__(self, ledger: Ledger, budgets: Budgets) -> None:
        self.ledger = ledger
        self.budgets = budgets

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        state = self.ledger.state
        yield GaugeMetricFamily(
            "helexa_database_up",
            "1 while the database takes the books' writes",
            value=1.0 if state.database_ok else 0.0,
        )
        yield GaugeMetricFamily(
            "helexa_ledger_backlog",
            "Ledger rows and settlements waiting for the database",
            value=self.ledger.backlog,
        )
        yield CounterMetricFamily(
            "helexa_ledger_dropped",
            "Writes the database refused, logged and dropped",
            value=state.dropped,
        )
        tokens, _cost = self.budgets.outstanding()
        yield GaugeMetricFamily(
            "helexa_budget_reserved_tokens", "Tokens this gateway holds reserved", value=tokens
        )
        yield CounterMetricFamily(
            "helexa_reservations_expired_booked",
            "Reservations of stopped gateways this gateway booked as spent",
            value=self.budgets.expired_booked,
        )
