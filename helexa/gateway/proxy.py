"""The pass-through to a node: a request sent to the best of its candidate routes (the next
one tried once when the first fails before answering), with the client's headers less the
hop-by-hop ones. Relaying the answer and settling its books is the exchange's (exchange.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from helexa.errors import service_unavailable
from helexa.gateway.connections import Connections
from helexa.gateway.fleet import KEY_REFUSED
from helexa.gateway.node_http import NodeResponse
from helexa.gateway.poller import KEY_HINT, describe_error
from helexa.gateway.router import NO_NODE_RETRY_AFTER_S, Route
from helexa.logs import event
from helexa.protocol.wire import exchange_usage_path

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
    "expect",  # the gateway has the whole body before it asks a node: nothing to wait for
    "proxy-authorization",
}
DROP_RESPONSE = {
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "server",
    "date",
}
PRINCIPAL_PREFIX = "x-helexa-"
USAGE_WAIT_S = 10.0  # each ask's wait for a cut exchange to end (the node's most)
# A cut exchange's usage is asked for (off the request's path) until the node has it: the
# node answers once its engine reported on the request, which a loaded CPU can take seconds
# over, and a worker that never does is faulted by the node's watchdog (step_timeout_s,
# 120 s by default) within this
USAGE_ASK_FOR_S = 300.0


def warn(what: str, route: Route, path: str, **fields: object) -> None:
    """One structured warning about a proxied request."""
    event(
        log, logging.WARNING, what, node=route.node.name, model=route.model_id, path=path, **fields
    )


def forward_headers(
    headers: Mapping[str, str], drop: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The client's headers for the node, less hop-by-hop ones, any client-sent
    `x-helexa-*` principal claims (the gateway stamps its own) and `drop` (lower case)."""
    out = {}
    for k, v in headers.items():
        name = k.lower()
        if name not in _DROP_REQUEST and name not in drop and not name.startswith(PRINCIPAL_PREFIX):
            out[k] = v
    return out


class Upstream:
    """Sends a request to one of its candidate routes; what it means is the exchange's."""

    def __init__(self, connections: Connections, idle_timeout_s: float = 300.0) -> None:
        self.connections = connections
        # a node silent this long while answering (a hung or stopped process) is cut
        self.idle_timeout_s = idle_timeout_s

    async def exchange_usage(self, route: Route, exchange_id: str) -> dict[str, Any] | None:
        """What the node says an exchange used, once it has seen it end: asked again while
        it answers 409 (still running: its engine has not reported yet), for up to
        USAGE_ASK_FOR_S; None when the node cannot say (gone, too old, or a node that predates
        the endpoint)."""
        url = route.base_url + exchange_usage_path(exchange_id)
        deadline = time.monotonic() + USAGE_ASK_FOR_S
        while True:
            wait_s = max(0.0, min(USAGE_WAIT_S, deadline - time.monotonic()))
            try:
                async with self.connections.session.get(
                    url,
                    params={"wait_s": f"{wait_s:.3f}"},
                    headers=route.node.auth_headers(),
                    timeout=aiohttp.ClientTimeout(total=wait_s + 5),
                ) as resp:
                    status = resp.status
                    answer = await resp.json(content_type=None) if status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                warn("could not ask the node what a cut exchange used", route, url, error=repr(e))
                return None
            if status == 200:
                usage = answer.get("usage") if isinstance(answer, dict) else None
                return usage if isinstance(usage, dict) else None
            if status != 409 or time.monotonic() >= deadline:
                if status == 409:
                    warn("a cut exchange still ran when the gateway stopped asking", route, url)
                return None

    async def open(
        self,
        routes: list[Route],
        path: str,
        body: bytes,
        headers: dict[str, str],
        tried: list[Route] | None = None,
    ) -> tuple[Route, NodeResponse]:
        """Send to the best route; when it fails before answering (refused, reset, 503, our
        key refused), try the next one once. The client is told which node failed, never
        how: the wire detail is logged. `tried` collects each route the request went to."""
        failed: list[str] = []
        for i, route in enumerate(routes[:2]):
            retry_left = i + 1 < min(2, len(routes))
            if tried is not None:
                tried.append(route)  # the node may work on it before it answers
            try:
                resp = await self.connections.pool.post(
                    route.base_url + path,
                    body,
                    headers | route.node.auth_headers(),
                    self.idle_timeout_s,
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
