"""The pass-through to a node: bytes relayed as they arrive, status and headers intact, the
upstream request cancelled when the client leaves, token counts read from the upstream's
own usage (never re-tokenized)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from helexa.errors import service_unavailable
from helexa.gateway.accounting import Accountant, finish_reason, settled_counts, usage_counts
from helexa.gateway.auth import ANONYMOUS, Principal
from helexa.gateway.budgets import Reservation
from helexa.gateway.fleet import KEY_REFUSED
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.poller import KEY_HINT, describe_error
from helexa.gateway.request_log import RequestRecord
from helexa.gateway.router import NO_NODE_RETRY_AFTER_S, Route, Router
from helexa.logs import event

log = logging.getLogger(__name__)

# Request headers that describe one hop, or that the gateway sets itself.
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "accept-encoding",  # the gateway reads usage from the body: ask for it uncompressed
    "proxy-authorization",
}
_DROP_RESPONSE = {
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "server",
    "date",
}
PRINCIPAL_PREFIX = "x-helexa-"
USAGE_TAIL_BYTES = 64 << 10


def warn(what: str, route: Route, path: str, **fields: object) -> None:
    """One structured warning about a proxied request."""
    event(
        log, logging.WARNING, what, node=route.node.name, model=route.model_id, path=path, **fields
    )


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers for the node, less hop-by-hop ones and any client-sent
    `x-helexa-*` principal claims (the gateway stamps its own)."""
    return {
        k: v
        for k, v in headers.items()
        if k.lower() not in _DROP_REQUEST and not k.lower().startswith(PRINCIPAL_PREFIX)
    }


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_RESPONSE}


def extract_usage(text: str) -> dict[str, Any] | None:
    """The last `"usage": {...}` object in an SSE tail or a JSON body, if any."""
    decoder = json.JSONDecoder()
    end = len(text)
    while True:
        at = text.rfind('"usage"', 0, end)
        if at < 0:
            return None
        brace = text.find("{", at)
        colon = text.find(":", at)
        if 0 <= colon < brace and text[colon + 1 : brace].strip() == "":
            try:
                value, _ = decoder.raw_decode(text, brace)
            except ValueError:
                value = None
            if isinstance(value, dict) and (
                "completion_tokens" in value or "output_tokens" in value
            ):
                return value
        end = at


@dataclass(slots=True)
class Exchange:
    """One proxied request: timing for the metrics, the route for the router's books."""

    route: Route | None
    model: str
    principal: Principal = ANONYMOUS
    reservation: Reservation | None = None
    prompt_estimate: int = 0
    price: tuple[float, float] = (0.0, 0.0)  # USD per 1M input, output tokens
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    last_byte: float | None = None
    content_events: int = 0  # SSE chunks carrying text: the fallback token count
    tail: bytearray = field(default_factory=bytearray)
    record: RequestRecord | None = None  # the request's log line, held open until we finish


class Upstream:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        router: Router,
        metrics: GatewayMetrics,
        accountant: Accountant | None = None,
    ):
        self.session = session
        self.router = router
        self.metrics = metrics
        self.accountant = accountant

    async def open(
        self, routes: list[Route], path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[Route, aiohttp.ClientResponse]:
        """Send to the best route; when it fails before answering (refused, reset, 503, our
        key refused), try the next one once. The client is told which node failed, never
        how: the wire detail is logged."""
        failed: list[str] = []
        for i, route in enumerate(routes[:2]):
            retry_left = i + 1 < min(2, len(routes))
            try:
                resp = await self.session.post(
                    route.base_url + path, data=body, headers=headers | route.node.auth_headers()
                )
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                error = describe_error(e)
                warn(
                    "proxy failure: node unreachable, it leaves routing until it answers",
                    route,
                    path,
                    error=error,
                )
                route.node.mark_down(error)
                failed.append(route.node.name)
                continue
            if resp.status == 401:  # the node's 401 is about our key, not the client's
                warn("proxy failure: the node refused the gateway's api_key", route, path)
                resp.release()
                route.node.mark_down(
                    f"it refused the gateway's api_key (401): {KEY_HINT}", KEY_REFUSED
                )
                failed.append(route.node.name)
                continue
            if resp.status == 503 and retry_left:
                warn(
                    "proxy failure: 503, trying the next replica",
                    route,
                    path,
                    retry_after=resp.headers.get("Retry-After"),
                )
                resp.release()
                continue
            return route, resp
        if failed:
            names = ("nodes " if len(failed) > 1 else "node ") + ", ".join(failed)
            message = f"{names} could not be reached; retry shortly"
        else:
            message = "every replica is busy; retry shortly"
        raise service_unavailable(message, NO_NODE_RETRY_AFTER_S)

    async def relay(self, ex: Exchange, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """Stream the upstream body through; settle metrics and books however it ends."""
        complete = False
        try:
            async for chunk in resp.content.iter_any():
                self._seen(ex, chunk)
                yield chunk
            complete = True
        finally:
            if complete:
                resp.release()
            else:  # the client left (or the node did): drop the upstream connection too
                resp.close()
                if ex.record is not None and finish_reason(ex) is None:
                    ex.record.cut = True
            self.finish(ex, resp.status)

    async def read(self, ex: Exchange, resp: aiohttp.ClientResponse) -> bytes:
        try:
            data = await resp.read()
        except BaseException:  # the node broke off (or the client left): settle all the same
            resp.close()
            self.finish(ex, 502)
            raise
        resp.release()
        self._seen(ex, data)
        self.finish(ex, resp.status)
        return data

    def _seen(self, ex: Exchange, chunk: bytes) -> None:
        now = time.monotonic()
        if ex.first_byte is None:
            ex.first_byte = now
        ex.last_byte = now
        ex.content_events += chunk.count(b'"content":"') - chunk.count(b'"content":""')
        ex.tail += chunk
        if len(ex.tail) > USAGE_TAIL_BYTES:
            del ex.tail[: len(ex.tail) - USAGE_TAIL_BYTES]

    def abandon(self, ex: Exchange, status: int) -> None:
        """A request that never reached a node: release its reservation, log its row."""
        if self.accountant is not None:
            self.accountant.close(ex, status, None)
        _settle_record(ex, status, None)

    def finish(self, ex: Exchange, status: int) -> None:
        assert ex.route is not None
        self.router.end(ex.route)
        labels = (ex.model, ex.route.node.name)
        m = self.metrics
        if ex.first_byte is not None and status == 200:
            m.ttft.labels(*labels).observe(ex.first_byte - ex.started)
        usage = extract_usage(ex.tail.decode("utf-8", "replace")) if status == 200 else None
        if self.accountant is not None:
            self.accountant.close(ex, status, usage)
        _settle_record(ex, status, usage)
        if usage:
            prompt, completion, _, _ = usage_counts(usage)
            m.prompt_tokens.labels(*labels).inc(prompt)
            m.completion_tokens.labels(*labels).inc(completion)
            window = (ex.last_byte or 0) - (ex.first_byte or 0)
            if completion > 1 and window <= 0:
                window = (ex.last_byte or time.monotonic()) - ex.started
            if completion > 0 and window > 0:
                m.tokens_per_second.labels(*labels).observe(completion / window)


def _settle_record(ex: Exchange, status: int, usage: dict[str, Any] | None) -> None:
    """What the exchange learned, into its request's log line (written once all ended)."""
    record = ex.record
    if record is None:
        return
    record.prompt_tokens, record.completion_tokens, _, _ = settled_counts(ex, status, usage)
    record.finish_reason = finish_reason(ex)
    record.first_byte = ex.first_byte
    record.node = ex.route.node.name if ex.route is not None else None
    record.release()
