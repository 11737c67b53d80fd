"""The OpenAI pass-through routes (`POST /v1/chat/completions`, `/v1/completions`,
`/v1/responses`) answered as bare ASGI: the gateway's hot path.

Their Litestar handlers stay registered (they carry the API document), but `GatewayASGI`
sends these requests here, because framework work per request (routing, dependency
injection, a response object, a task group per stream) cost more than everything else the
gateway does for an anonymous request. What the handlers did, this does the same way:
authenticate, read the body, open the exchange, relay or read the node's answer; a client
that leaves cancels the work (and so the node's request); every failure is the OpenAI
envelope `_handle_error` would have sent, logged as it would have logged it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import aiohttp
import msgspec

from helexa.errors import HelexaError, invalid_request
from helexa.gateway.exchange import Reply
from helexa.gateway.request_log import RECORD_STATE, RequestRecord
from helexa.gateway.service import Gateway
from helexa.logs import event
from helexa.web.common import helexa_error, parse_json_body, send_envelope

log = logging.getLogger("helexa.web.gateway_app")  # the handlers' logger: one name for both

PASSTHROUGH_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
CLIENT_LEFT = 499  # nginx's status for a request whose client went first

_decoder = msgspec.json.Decoder()
_MORE = {"type": "http.response.body", "more_body": True}


def body_object(raw: bytes) -> dict[str, Any]:
    """The request body as the JSON object a pass-through route takes, naming its model."""
    body = parse_json_body(raw, _decoder.decode)
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("model: expected a non-empty string", "model")
    return body


def too_large(max_body_mb: int) -> HelexaError:
    return HelexaError(
        413,
        "invalid_request_error",
        f"the request body is larger than {max_body_mb} MiB, the gateway's limit "
        "([http] max_body_mb)",
        code="request_too_large",
    )


def client_error(exc: Exception, method: str, path: str) -> HelexaError:
    """What a client is told of `exc` on an API route: a node's answer that broke off is
    the gateway's 502 (its wire detail goes to the log only); a refusal is logged."""
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        event(log, logging.WARNING, "node answer failed", path=path, error=repr(exc))
        exc = HelexaError(
            502, "server_error", "the node's answer broke off; retry", code="upstream_error"
        )
    err = helexa_error(exc, method, path)
    if isinstance(exc, HelexaError):
        event(
            log,
            logging.WARNING,
            "request refused",
            path=path,
            status=err.status,
            code=err.code,
            error=err.message,
        )
    return err


def request_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """A request's raw headers (as an ASGI scope or the lane holds them) by lower-case name
    (the first of a repeated one)."""
    out: dict[str, str] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name not in out:
            out[name] = v.decode("latin-1")
    return out


class ClientLeft(Exception):
    """The client went before its request's body had all come."""


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """The request's whole body; None when it runs past `limit` bytes. ClientLeft when
    the client goes first."""
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body if len(body) <= limit else None
    parts, size = [body], len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def head_headers(reply: Reply, length: int | None = None) -> list[tuple[bytes, bytes]]:
    """The answer's headers for the client: the node's (less hop-by-hop ones), its
    content type (a text type with its charset) and, for a whole answer, its length."""
    media_type = reply.media_type
    if media_type.startswith("text/"):
        media_type += "; charset=utf-8"
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    headers.append((b"content-type", media_type.encode("latin-1")))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return headers


class Wire(Protocol):
    """Where a pass-through request is read from and answered to: ASGI messages
    (`AsgiWire`), or the socket itself (`gateway_lane.LaneWire`). Once `watch`ed, a client
    that leaves before the answer is whole cancels the request's task and sets `left`; a
    disconnect once `answered` is set changes nothing."""

    left: bool
    answered: bool

    async def body(self, limit: int) -> bytes | None:
        """The whole request body; None past `limit` bytes; ClientLeft when the client goes."""
        ...

    def watch(self) -> None: ...

    def unwatch(self) -> None: ...

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def reply(self, reply: Reply, length: int | None = None) -> None:
        """The head of a node's answer (`head_headers`)."""
        ...

    async def send(self, chunk: bytes) -> None:
        """A part of the answer's body, more to come."""
        ...

    async def end(self, chunk: bytes = b"") -> None:
        """The answer's last part: the answer is whole."""
        ...

    async def gone(self) -> None:
        """The answer to a client that has gone: a 499 into the void (the server drops it),
        for the log line and the request counter."""
        ...

    async def error(self, err: HelexaError) -> None:
        """`err` as the whole answer: the OpenAI envelope, its status and headers."""
        ...


class AsgiWire:
    """A pass-through request as ASGI messages (the Litestar door, and a server without
    the lane); once watched, a task waits for the client's disconnect."""

    __slots__ = ("answered", "left", "receive", "send_", "task")

    def __init__(self, receive: Any, send: Any) -> None:
        self.receive = receive
        self.send_ = send
        self.answered = False
        self.left = False
        self.task: asyncio.Future[None] | None = None

    async def body(self, limit: int) -> bytes | None:
        return await _read_body(self.receive, limit)

    def watch(self) -> None:
        self.task = asyncio.ensure_future(self._wait(asyncio.current_task()))

    async def _wait(self, request: asyncio.Task[Any] | None) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if not self.answered and request is not None:
            self.left = True
            request.cancel()

    def unwatch(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send_({"type": "http.response.start", "status": status, "headers": headers})

    async def reply(self, reply: Reply, length: int | None = None) -> None:
        await self.start(reply.status, head_headers(reply, length))

    async def send(self, chunk: bytes) -> None:
        await self.send_({**_MORE, "body": chunk})

    async def end(self, chunk: bytes = b"") -> None:
        await self.send_({"type": "http.response.body", "body": chunk})

    async def gone(self) -> None:
        await self.send_({"type": "http.response.start", "status": CLIENT_LEFT, "headers": []})
        await self.send_({"type": "http.response.body", "body": b""})

    async def error(self, err: HelexaError) -> None:
        await send_envelope(self.send_, err)


class Passthrough:
    """The pass-through routes (POST `PASSTHROUGH_PATHS`) over one gateway: an ASGI app,
    and `serve` over any `Wire`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_body_mb = gateway.cfg.http.max_body_mb
        self.limit = self.max_body_mb << 20

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        record = scope.get("state", {}).get(RECORD_STATE)
        await self.serve(
            AsgiWire(receive, send), scope["path"], request_headers(scope["headers"]), record
        )

    async def serve(
        self, wire: Wire, path: str, headers: dict[str, str], record: RequestRecord | None
    ) -> None:
        """Authenticate, read the body, open the exchange, relay or read the node's answer.
        A client that leaves cancels the work (and so the node's request); every failure
        is the OpenAI envelope, logged as `_handle_error` logs it."""
        try:
            principal = await self.gateway.auth.authenticate(headers)
            raw = await wire.body(self.limit)
            if raw is None:
                raise too_large(self.max_body_mb)
            body = body_object(raw)
        except ClientLeft:
            await wire.gone()
            return
        except Exception as exc:
            await wire.error(client_error(exc, "POST", path))
            return
        wire.watch()
        started = False
        try:
            exchanges = self.gateway.exchanges
            reply = await exchanges.open(principal, path, body, raw, headers, record)
            if reply.is_stream:
                await wire.reply(reply)
                started = True
                async for chunk in exchanges.relay(reply):
                    if wire.answered:
                        continue  # the answer's end went out; what is left is the books'
                    if reply.ends_with(chunk):  # the end out before the books read it
                        wire.answered = True
                        await wire.end(chunk)
                    else:
                        await wire.send(chunk)
                if not wire.answered:
                    wire.answered = True
                    await wire.end()
            else:
                data, arrived = await exchanges.fetch(reply)
                wire.answered = True
                try:  # the answer out first, then its books (however the sending ends)
                    await wire.reply(reply, len(data))
                    started = True
                    await wire.end(data)
                finally:
                    exchanges.settle_whole(reply, data, arrived)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not wire.left or current is None:
                raise  # not the client leaving: the server's own cancellation
            current.uncancel()
            if not started:
                await wire.gone()
        except Exception as exc:
            if started:
                raise  # the head is out: the connection is cut, as any server would
            await wire.error(client_error(exc, "POST", path))
        finally:
            wire.unwatch()
