"""The gateway's outermost layer, around its Litestar app: what every HTTP request gets
whichever route (or none) answers it — an `x-request-id`, CORS, the request counter — and,
for API requests (`/v1/...`), the one log line when it ends.

It sits outside Litestar so that a CORS preflight is answered before any handler (and its
auth) runs, and so that errors, 404s and 405s get the same headers as answers do.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from litestar import Litestar

from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.request_log import RECORD_STATE, RequestRecord
from helexa.logs import request_id
from helexa.protocol.wire import REQUEST_ID_HEADER
from helexa.web.common import scope_header
from helexa.web.gateway_passthrough import PASSTHROUGH_PATHS, Passthrough

# bounded label values for helexa_requests_total{route}
ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/health",
    "/version",
}
# What browser clients of the OpenAI and Anthropic APIs send (the SDKs add `x-stainless-*`
# ones, which a preflight names and gets back).
ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "x-request-id",
)
EXPOSE_HEADERS = "x-request-id, x-helexa-node, retry-after, request-id"
ALLOW_METHODS = "GET, POST, HEAD, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
_REQUEST_ID = REQUEST_ID_HEADER.encode()

Headers = list[tuple[bytes, bytes]]


class Cors:
    """`[gateway] cors_allow_origins`: exact origins ("https://app.example"), or "*"."""

    def __init__(self, origins: list[str]) -> None:
        self.any = "*" in origins
        self.origins = {o.rstrip("/") for o in origins if o != "*"}

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def allow_origin(self, origin: str) -> bytes:
        return b"*" if self.any else origin.encode("latin-1")

    def preflight(self, origin: str, requested: str) -> tuple[int, Headers, bytes]:
        """The answer to an `OPTIONS` preflight: 204 and what may be sent, or 403."""
        if not self.allows(origin):
            body = msgspec.json.encode(
                {
                    "error": {
                        "message": f"origin {origin!r} is not in [gateway] cors_allow_origins",
                        "type": "invalid_request_error",
                        "code": None,
                        "param": None,
                    }
                }
            )
            return 403, [(b"content-type", b"application/json"), (b"vary", b"Origin")], body
        names = dict.fromkeys(ALLOW_HEADERS)
        names |= dict.fromkeys(
            h.strip().lower() for h in requested.split(",") if _TOKEN.fullmatch(h.strip())
        )
        headers = [
            (b"access-control-allow-origin", self.allow_origin(origin)),
            (b"access-control-allow-methods", ALLOW_METHODS.encode()),
            (b"access-control-allow-headers", ", ".join(names).encode()),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
            (b"vary", b"Origin"),
        ]
        return 204, headers, b""

    def response_headers(self, headers: Headers, origin: str | None) -> Headers:
        """An answer's headers with `Vary: Origin`, and the allow headers for an allowed
        origin; a disallowed one gets none."""
        out = [(k, v) for k, v in headers if k.lower() != b"vary"]
        vary = [v.decode("latin-1") for k, v in headers if k.lower() == b"vary"]
        if not any("origin" in v.lower() or "*" in v for v in vary):
            vary.append("Origin")
        out.append((b"vary", ", ".join(vary).encode("latin-1")))
        if origin is not None and self.allows(origin):
            out.append((b"access-control-allow-origin", self.allow_origin(origin)))
            out.append((b"access-control-expose-headers", EXPOSE_HEADERS.encode()))
        return out


class GatewayASGI:
    """The API app with request ids, CORS, counting and the per-request log line."""

    def __init__(
        self, app: Litestar, passthrough: Passthrough, metrics: GatewayMetrics, cors: Cors | None
    ) -> None:
        self.app = app
        self.passthrough = passthrough  # the OpenAI pass-through routes, past Litestar
        self.metrics = metrics
        self.cors = cors
        self.state = app.state

    def response_headers(
        self, headers: Headers, rid: bytes, origin: str | None, path: str
    ) -> Headers:
        """An answer's headers as they leave the door: its request id (the sane one), and
        CORS's when configured (never on the console's pages)."""
        headers = [(k, v) for k, v in headers if k.lower() != _REQUEST_ID]
        headers.append((_REQUEST_ID, rid))
        if self.cors is not None and not path.startswith("/admin"):
            headers = self.cors.response_headers(headers, origin)
        return headers

    def count(self, path: str, method: str, status: int, record: RequestRecord) -> None:
        """The request is over: counted, and its log line written (API requests; now, or
        when its exchange with a node settles)."""
        route = path if path in ROUTES else "other"
        self.metrics.child(self.metrics.requests, route, str(status)).inc()
        record.status = status
        if path.startswith("/v1/") and method != "OPTIONS":
            record.end()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        rid = request_id(scope_header(scope, _REQUEST_ID))
        # the handlers (and the node, through them) see the sane id, never the client's raw one
        rid_bytes = rid.encode()
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != _REQUEST_ID]
        scope["headers"].append((_REQUEST_ID, rid_bytes))
        record = RequestRecord(rid)
        scope.setdefault("state", {})[RECORD_STATE] = record
        origin = scope_header(scope, b"origin")
        cors = self.cors if self.cors is not None and not path.startswith("/admin") else None
        status = 500

        async def wrapped_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = self.response_headers(message.get("headers", []), rid_bytes, origin, path)
                message = {**message, "headers": headers}
            await send(message)

        try:
            requested = scope_header(scope, b"access-control-request-method")
            if cors is not None and scope["method"] == "OPTIONS" and origin and requested:
                code, headers, body = cors.preflight(
                    origin, scope_header(scope, b"access-control-request-headers") or ""
                )
                status = code  # answered here, before any handler or auth
                headers.append((_REQUEST_ID, rid_bytes))
                await send({"type": "http.response.start", "status": code, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if scope["method"] == "POST" and path in PASSTHROUGH_PATHS:
                await self.passthrough(scope, receive, wrapped_send)
            else:
                await self.app(scope, receive, wrapped_send)
        finally:
            self.count(path, scope["method"], status, record)
