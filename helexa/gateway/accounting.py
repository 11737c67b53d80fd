"""After a proxied request: settle its budget reservation, write its ledger row, count
its spend — from the node's own usage, or, for a stream cut before its usage arrived,
from the content chunks that did arrive."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from helexa.gateway.budgets import Budgets
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from helexa.gateway.proxy import Exchange

_FINISH = re.compile(rb'"finish_reason":\s*"([a-z_]+)"')


class Accountant:
    def __init__(self, budgets: Budgets, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self.budgets = budgets
        self.ledger = ledger
        self.metrics = metrics

    def close(self, ex: Exchange, status: int, usage: dict[str, Any] | None) -> None:
        if usage:
            prompt = int(usage.get("prompt_tokens") or 0)
            completion = int(usage.get("completion_tokens") or 0)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            reasoning = int(
                (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
            )
        elif ex.first_byte is not None and status == 200:  # cut short: count what came
            prompt, completion, cached, reasoning = ex.prompt_estimate, ex.content_events, 0, 0
        else:  # never ran
            prompt = completion = cached = reasoning = 0
        in_price, out_price = ex.price
        cost = (prompt * in_price + completion * out_price) / 1e6
        if ex.reservation is not None:
            self.budgets.settle(ex.reservation, prompt + completion, cost)
        finish = _FINISH.findall(bytes(ex.tail))
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
            finish_reason=finish[-1].decode() if finish else None,
            ttft_ms=(ex.first_byte - ex.started) * 1000 if ex.first_byte else None,
            latency_ms=((ex.last_byte or ex.first_byte or ex.started) - ex.started) * 1000,
        )
        if key is not None and prompt + completion:
            self.metrics.spend_tokens.labels(key.account_id, key.id).inc(prompt + completion)
