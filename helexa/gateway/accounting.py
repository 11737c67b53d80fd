"""After a proxied request: settle its budget reservation, write its ledger row, count
its spend — from the node's own usage, or, for a stream cut before its usage arrived,
from the content chunks that did arrive."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from helexa.gateway.budgets import Budgets
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.protocol.wire import cost_usd

if TYPE_CHECKING:
    from helexa.gateway.proxy import Exchange

_FINISH = re.compile(rb'"finish_reason":\s*"([a-z_]+)"')


def usage_counts(usage: dict[str, Any]) -> tuple[int, int, int, int]:
    """(prompt, completion, cached, reasoning) tokens of a chat/completions usage object or
    of a Responses one (`input_tokens`, `output_tokens`, `*_details`)."""

    def num(obj: Any, key: str) -> int | None:
        value = obj.get(key) if isinstance(obj, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def first(*candidates: int | None) -> int:
        return next((c for c in candidates if c is not None), 0)

    prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    output_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    return (
        first(num(usage, "prompt_tokens"), num(usage, "input_tokens")),
        first(num(usage, "completion_tokens"), num(usage, "output_tokens")),
        first(num(prompt_details, "cached_tokens")),
        first(num(output_details, "reasoning_tokens")),
    )


def settled_counts(
    ex: Exchange, status: int, usage: dict[str, Any] | None
) -> tuple[int, int, int, int]:
    """(prompt, completion, cached, reasoning) tokens to settle: the node's usage, or for a
    stream cut before it, the prompt estimate and the content chunks that arrived."""
    if usage:
        return usage_counts(usage)
    if ex.first_byte is not None and status == 200:  # cut short: count what came
        return ex.prompt_estimate, ex.content_events, 0, 0
    return 0, 0, 0, 0  # never ran


def finish_reason(ex: Exchange) -> str | None:
    """The last `finish_reason` the node sent (in the tail of its answer), if any."""
    found = _FINISH.findall(bytes(ex.tail))
    return found[-1].decode() if found else None


class Accountant:
    def __init__(self, budgets: Budgets, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self.budgets = budgets
        self.ledger = ledger
        self.metrics = metrics

    def close(self, ex: Exchange, status: int, usage: dict[str, Any] | None) -> None:
        prompt, completion, cached, reasoning = settled_counts(ex, status, usage)
        in_price, out_price = ex.price
        cost = cost_usd(prompt, completion, in_price, out_price)
        if ex.reservation is not None:
            self.budgets.settle(ex.reservation, prompt + completion, cost)
        key = ex.principal.key
        self.ledger.record(
            account_id=key.account_id if key else None,
            key_id=key.id if key else None,
            model=ex.model,
            node=ex.route.node.name if ex.route else None,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            reasoning_tokens=reasoning,
            cost_usd=cost,
            status=status,
            finish_reason=finish_reason(ex),
            ttft_ms=(ex.first_byte - ex.started) * 1000 if ex.first_byte else None,
            latency_ms=((ex.last_byte or ex.first_byte or ex.started) - ex.started) * 1000,
        )
        if key is not None and prompt + completion:
            self.metrics.spend_tokens.labels(key.account_id, key.id).inc(prompt + completion)
