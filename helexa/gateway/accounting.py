"""After a proxied request: what the node's answer said, and the books — settle the budget
reservation and write the ledger row (one durable step), count the spend. A request on
which no model ran writes no row (the ledger grows only with work). Counts come from
the node's own usage (on errors too: an error envelope that ran the model carries it), or,
for a stream cut before its usage arrived, from what the node says the exchange used
(`GET /v1/exchanges/{id}/usage`) and never less than the generated-text events that did
arrive."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from helexa.gateway.auth import ANONYMOUS, Principal
from helexa.gateway.budgets import Budgets, Reservation
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.request_log import RequestRecord
from helexa.gateway.router import Route
from helexa.logs import new_id
from helexa.protocol.wire import FREE, Price, SSEReader

_decode = msgspec.json.Decoder().decode
# Responses API events whose `delta` is generated text (answer, reasoning, call arguments)
TEXT_DELTA_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
    }
)
# The events that end a stream: the ledger row is durable before they are relayed.
TERMINAL_RESPONSES_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "error"}
)


class Tally:
    """What a node's answer said, for the books: a stream's events parsed as they are
    relayed (however its bytes are split), or a whole JSON body parsed once."""

    __slots__ = (
        "_reader",
        "ended",
        "error",
        "finish_reason",
        "first_byte",
        "first_token",
        "last_byte",
        "text_events",
        "usage",
    )

    def __init__(self) -> None:
        self._reader = SSEReader()
        self.text_events = 0  # per choice, events carrying generated text: the fallback count
        self.finish_reason: str | None = None  # the last one the node sent
        self.usage: dict[str, Any] | None = None  # the last usage object the node sent
        self.first_byte: float | None = None
        # when the first generated text arrived: a stream's first byte is the role chunk the
        # node sends before its engine has run, so this, not it, is the time to first token
        self.first_token: float | None = None
        self.last_byte: float | None = None
        self.ended = False  # the stream's last event arrived (`[DONE]`, response.completed…)
        self.error = False  # the node sent an error (an envelope, or an error event)

    def feed(self, chunk: bytes, at: float | None = None) -> bool:
        """One chunk of a stream (arrived at `at`, monotonic; default now), as it is
        relayed; True when it holds the stream's end."""
        self._arrived(at)
        had_text = self.text_events
        for event in self._reader.feed(chunk):
            if event.data.strip() == "[DONE]":
                self.ended = True
                continue
            obj = _parse(event.data)
            self._read(obj, event.name, "delta")
            kind = obj.get("type") if isinstance(obj, dict) else None
            if (kind or event.name) in TERMINAL_RESPONSES_EVENTS:
                self.ended = True
            elif isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                self.ended = True  # the node's error event: nothing follows but `[DONE]`
        if self.first_token is None and self.text_events > had_text:
            self.first_token = self.last_byte
        return self.ended

    def whole(self, body: bytes, at: float | None = None) -> None:
        """A non-stream answer, all of it (arrived at `at`, monotonic; default now)."""
        self._arrived(at)
        self._read(_parse(body), None, "message")
        self.first_token = self.first_byte  # all of it at once: its time is the first token's

    def _arrived(self, at: float | None) -> None:
        now = time.monotonic() if at is None else at
        if self.first_byte is None:
            self.first_byte = now
        self.last_byte = now

    def _read(self, obj: Any, name: str | None, part: str) -> None:
        """One chat or completions chunk (or body), or one Responses event."""
        if not isinstance(obj, dict):
            return  # nothing we understand
        usage = obj.get("usage")
        error = obj.get("error")
        if isinstance(error, dict):  # an envelope: it carries usage when the model ran
            self.error = True
            usage = error.get("usage", usage)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                self.text_events += _has_text(choice, part)
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason:
                    self.finish_reason = reason
        else:
            if (obj.get("type") or name) in TEXT_DELTA_EVENTS and obj.get("delta"):
                self.text_events += 1
            response = obj.get("response")  # response.completed / .incomplete carry it
            if usage is None and isinstance(response, dict):
                usage = response.get("usage")
        if isinstance(usage, dict) and ("completion_tokens" in usage or "output_tokens" in usage):
            self.usage = usage


def _parse(data: str | bytes) -> Any:
    try:
        return _decode(data)
    except msgspec.DecodeError:
        return None


def _has_text(choice: dict[str, Any], part: str) -> bool:
    """Whether a choice (its `delta`, or a whole answer's `message`) carries generated text:
    content, reasoning, tool-call arguments, or a completion's `text`."""
    if choice.get("text"):
        return True
    delta = choice.get(part)
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning_content"):
        return True
    calls = delta.get("tool_calls")
    return isinstance(calls, list) and any(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and c["function"].get("arguments")
        for c in calls
    )


@dataclass(slots=True)
class Exchange:
    """One request's exchange with a node, as its books see it."""

    model: str  # the catalogue's name for it (never an alias): the ledger's
    principal: Principal = ANONYMOUS
    id: str = field(default_factory=lambda: "ex_" + new_id())  # the node's handle
    route: Route | None = None  # once a node took it
    reservation: Reservation | None = None
    prompt_estimate: int = 0
    price: Price = FREE  # the catalogue's, USD per 1M tokens
    started: float = field(default_factory=time.monotonic)
    tally: Tally = field(default_factory=Tally)
    record: RequestRecord | None = None  # the request's log line, held open until settled
    # what the node said the exchange used, asked after a cut (None: not asked, or no answer)
    node_usage: dict[str, Any] | None = None
    cut: bool = False  # the answer ended before the node finished it (client or node gone)
    closer: Callable[[], None] | None = None  # drops the node's answer (its connection)
    settled: bool = False


Counts = tuple[int, int, int, int, int]  # prompt, completion, cached, cache-written, reasoning


def usage_counts(usage: dict[str, Any]) -> Counts:
    """(prompt, completion, cached, cache-written, reasoning) tokens of a chat/completions
    usage object or of a Responses one (`input_tokens`, `output_tokens`, `*_details`);
    `cache_write_tokens` (OpenRouter's name) counts the prompt tokens the node stored in its
    prefix cache."""

    def num(obj: Any, key: str) -> int | None:
        value = obj.get(key) if isinstance(obj, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def first(*candidates: int | None) -> int:
        return next((c for c in candidates if c is not None), 0)

    prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    output_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    return (  # the details at the top level: the node's exchange usage (a cut answer's)
        first(num(usage, "prompt_tokens"), num(usage, "input_tokens")),
        first(num(usage, "completion_tokens"), num(usage, "output_tokens")),
        first(num(prompt_details, "cached_tokens"), num(usage, "cached_tokens")),
        first(num(prompt_details, "cache_write_tokens"), num(usage, "cache_write_tokens")),
        first(num(output_details, "reasoning_tokens"), num(usage, "reasoning_tokens")),
    )


def settled_counts(ex: Exchange) -> Counts:
    """(prompt, completion, cached, cache-written, reasoning) tokens to settle: the node's usage of its
    answer; for an answer cut before it, what the node said the exchange used (its engine's
    count after its last word on the request: the tokens the client never got included),
    never fewer completion tokens than generated-text events arrived; only where the node
    cannot say, what arrived (a text event a token, the prompt's estimate)."""
    usage = ex.tally.usage  # the node's own, of a whole answer (an error's included)
    if usage:
        return usage_counts(usage)
    if ex.node_usage:  # never believed below what arrived (each text event is a token)
        prompt, completion, cached, written, reasoning = usage_counts(ex.node_usage)
        return prompt, max(completion, ex.tally.text_events), cached, written, reasoning
    if ex.cut and ex.tally.first_byte is not None:  # cut, the node silent: count what came
        return ex.prompt_estimate, ex.tally.text_events, 0, 0, 0
    return 0, 0, 0, 0, 0  # never ran


class Accountant:
    def __init__(self, budgets: Budgets, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self.budgets = budgets
        self.ledger = ledger
        self.metrics = metrics

    def close(self, ex: Exchange, status: int) -> tuple[Counts, Any]:
        """Queue the exchange's settlement (its reservation replaced by its ledger row) and
        count its spend; returns the counts settled (as `settled_counts`) and the op's
        future, answered once the row is durable. An exchange on which no model ran (every
        count zero: refused by the node before its engine ran, or never reached it) writes
        no row, so the ledger grows only with work: its reservation is released and it is
        counted in `helexa_requests_unbooked_total`; the future is None when there is
        nothing to write."""
        counts = settled_counts(ex)
        key = ex.principal.key
        lock = key.id if key else ""
        if not any(counts):  # nothing ran: no row, only its reservation (if any) released
            labels = (key.account_id, key.id) if key else ("", "")
            self.metrics.child(self.metrics.unbooked, *labels, str(status)).inc()
            if ex.reservation is None:
                return counts, None
            return counts, self.budgets.release(ex.reservation, lock)
        prompt, completion, cached, written, reasoning = counts
        tally = ex.tally
        row = dict(
            account_id=key.account_id if key else None,
            key_id=key.id if key else None,
            model=ex.model,
            node=ex.route.node.name if ex.route else None,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            cache_write_tokens=written,
            reasoning_tokens=reasoning,
            cost_usd=ex.price.cost(prompt, completion, cached, written),
            status=status,
            finish_reason=tally.finish_reason,
            ttft_ms=(tally.first_token - ex.started) * 1000 if tally.first_token else None,
            latency_ms=((tally.last_byte or tally.first_byte or ex.started) - ex.started) * 1000,
        )
        future = self.budgets.settle(ex.reservation, row, lock)
        if key is not None and prompt + completion:
            m = self.metrics
            m.child(m.spend_tokens, key.account_id, key.id).inc(prompt + completion)
        return counts, future
