"""What both roles' HTTP layers share: JSON body decoding and the one place exceptions
become the OpenAI error envelope. (The node ↔ gateway headers are in protocol/wire.py.)

Nothing here imports the engine: the gateway process never loads torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Request
from litestar.exceptions import HTTPException
from litestar.response import Response
from litestar.types import Receive, Send

from helexa.errors import HelexaError, invalid_request

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def scope_header(scope: Any, name: bytes) -> str | None:
    """One request header straight from an ASGI scope (`name` lowercase), for the ASGI
    layers in front of the apps, which read a few headers and need no mapping of all."""
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def envelope(err: HelexaError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """`err` as a whole answer: its status, headers and the OpenAI envelope."""
    body = json.dumps(err.to_envelope(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    headers.append((b"content-length", str(len(body)).encode()))
    return err.status, headers, body


async def send_envelope(send: Send, err: HelexaError) -> None:
    """`err` as a whole ASGI response, for the layers below the apps that answer without
    a handler."""
    status, headers, body = envelope(err)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def parse_json_body(raw: bytes, decode: Callable[[bytes], Any] = json.loads) -> Any:
    """The decoded request body, or the 400 naming `body` when it is empty or not JSON."""
    if not raw.strip():
        raise invalid_request("the request body is empty; expected a JSON object", "body")
    try:
        return decode(raw)
    except RecursionError:
        raise invalid_request("the request body is nested too deeply", "body") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, msgspec.DecodeError
        raise invalid_request(f"the request body is not valid JSON: {e}", "body") from None


def as_helexa_error(request: Request, exc: Exception) -> HelexaError:
    """Any exception as the error a client sees (an unexpected one is logged, and a 500)."""
    return helexa_error(exc, request.method, request.url.path)


def helexa_error(exc: Exception, method: str, path: str) -> HelexaError:
    """`as_helexa_error` for a layer with no Litestar request (the method and path name an
    unexpected error in the log)."""
    if isinstance(exc, HelexaError):
        return exc
    if isinstance(exc, HTTPException):
        status = exc.status_code
        return HelexaError(
            status,
            "invalid_request_error" if status < 500 else "server_error",
            exc.detail if status < 500 else "internal server error",
        )
    log.exception("unhandled error on %s %s", method, path)
    return HelexaError(500, "server_error", f"internal server error: {type(exc).__name__}")


def error_response(request: Request, exc: Exception) -> Response:
    """Any exception as the OpenAI envelope with its status and headers (Retry-After)."""
    err = as_helexa_error(request, exc)
    return Response(content=err.to_envelope(), status_code=err.status, headers=err.headers())


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or a bodiless 499 once the client leaves first: the work is
    cancelled, so a whole answer long in coming is dropped (the node stops generating and
    frees its KV; the gateway drops the node's request), not finished for nobody."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(content=b"", status_code=499)
    return task.result()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass
