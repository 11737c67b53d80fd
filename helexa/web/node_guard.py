"""The node's door: every HTTP request passes here before any handler.

- Authentication: with `[node] api_key` set, every route but `GET /health` and the API
  document (`/openapi.json`, `/docs`) needs `Authorization: Bearer <api_key>` (compared in
  constant time); anything else is a 401. `[node] metrics_token`, where set, opens
  `GET /metrics` alone: a Prometheus scrapes without the key that loads models.
- Trust: whether the gateway's `x-helexa-*` headers on this request may be believed
  (`scope["state"]["trusted"]`): with an api_key, only requests that carry it get this
  far; without one, only loopback peers are believed.
- `x-request-id`: the caller's (when sane) or a new one, returned on every response.
- One log line per request when its response ends (`helexa.logs.request_done`), with
  what the handler left in `scope["state"]`: model, token counts, finish reason, TTFT.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from helexa.config import NodeConfig
from helexa.errors import invalid_api_key
from helexa.logs import request_done, request_id
from helexa.node.security import is_loopback, key_matches
from helexa.protocol.wire import REQUEST_ID_HEADER, SECRET_HEADER, bearer_token
from helexa.web.common import scope_header, send_envelope
from helexa.web.openapi import DOCUMENT_ROUTES

log = logging.getLogger("helexa.node.requests")
# /health, and the API document with its page (see helexa/web/openapi.py)
_OPEN = {(method, path) for method in ("GET", "HEAD") for path in ("/health", *DOCUMENT_ROUTES)}
_SCRAPE = {("GET", "/metrics"), ("HEAD", "/metrics")}  # what a metrics_token opens
_REQUEST_ID, _SECRET = REQUEST_ID_HEADER.encode(), SECRET_HEADER.encode()


class NodeGuard:
    """ASGI middleware: authentication, trust, request ids and the per-request log line."""

    def __init__(self, app: ASGIApp, node: NodeConfig) -> None:
        self.app = app
        self.api_key = node.api_key
        self.metrics_token = node.metrics_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope_header(scope, _REQUEST_ID))
        state: dict[str, Any] = scope.setdefault("state", {})  # type: ignore[typeddict-item]
        state["request_id"] = rid
        peer = (scope.get("client") or ("", 0))[0]
        method, path = scope["method"], scope["path"]
        t0 = time.perf_counter()
        seen: dict[str, Any] = {"status": 0, "logged": False}

        def finish() -> None:
            if seen["logged"]:
                return
            seen["logged"] = True
            quiet = method in ("GET", "HEAD") and seen["status"] < 400
            if quiet and not log.isEnabledFor(logging.DEBUG):
                return
            settling = state.get("settling")
            if settling is not None:  # a cut answer: written once the engine's count is in
                settling.append(write)
            else:
                write()

        def write() -> None:
            request_done(
                log,
                request_id=rid,
                model=state.get("model"),
                status=seen["status"] or 499,  # 499: the client left before an answer
                prompt_tokens=state.get("prompt_tokens"),
                completion_tokens=state.get("completion_tokens"),
                finish_reason=state.get("finish_reason"),
                ttft_ms=state.get("ttft_ms"),
                total_ms=(time.perf_counter() - t0) * 1000,
                route=f"{method} {path}",
                client=peer,
            )

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                message["headers"] = [
                    *message.get("headers", ()),
                    (REQUEST_ID_HEADER.encode(), rid.encode()),
                ]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finish()

        trusted = bool(self.api_key) or is_loopback(peer)
        if self.api_key and (method, path) not in _OPEN:
            given = bearer_token(scope_header(scope, b"authorization"))
            given = given or scope_header(scope, _SECRET)  # the deprecated header
            if self._scrapes(method, path, given):
                trusted = False  # a scraper, not the gateway
            elif not key_matches(given, self.api_key):
                await _unauthorized(
                    send_with_id,
                    "Authorization: Bearer <api_key> required"
                    if given is None
                    else "Invalid API key",
                )
                return
        state["trusted"] = trusted
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            finish()

    def _scrapes(self, method: str, path: str, given: str | None) -> bool:
        """Whether `given` is the metrics token and this request a scrape."""
        token = self.metrics_token
        return token is not None and (method, path) in _SCRAPE and key_matches(given, token)


async def _unauthorized(send: Send, message: str) -> None:
    err = invalid_api_key(f"{message}: this node requires its [node] api_key")
    err.extra_headers = {"WWW-Authenticate": 'Bearer realm="helexa-node"'}
    await send_envelope(send, err)
