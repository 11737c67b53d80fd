"""uvicorn's HTTP protocol with two guards it lacks: a deadline for a request's headers
(slow-header clients are dropped instead of held forever) and a deadline for a stalled
reader (a client that reads nothing while the server has data queued for it is cut, so
its request is cancelled and its slot and KV blocks are freed).

Both act on the connection, below the ASGI app: a cut looks to the app like any client
disconnect, which the streaming responses already handle.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from litestar.types import Receive, Scope, Send
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from helexa.errors import service_unavailable
from helexa.web.common import send_envelope

log = logging.getLogger(__name__)
_OVERLOADED = service_unavailable(
    "the server holds as many connections as [http] limit_concurrency allows; retry shortly", 1
)
_OVERLOADED.extra_headers = {"Connection": "close"}


async def _overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    """uvicorn's answer past `limit_concurrency`, as the OpenAI envelope (its own is text)."""
    await send_envelope(send, _OVERLOADED)


# With a write deadline, the kernel's send buffer is capped: autotuned, it grows to
# megabytes, and a client that reads nothing would hold its slot and KV blocks until
# thousands of tokens had been generated into it. 256 KiB still covers a LAN's
# bandwidth-delay product.
STALL_SEND_BUFFER = 256 << 10


def guarded_protocol(
    header_timeout_s: float,
    write_timeout_s: float | None,
    before: tuple[type[HttpToolsProtocol], ...] = (),
) -> type[HttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these deadlines, and `before`
    (subclasses of uvicorn's protocol, such as the gateway's lane) in front of them."""
    httptools_impl.service_unavailable = _overloaded  # the app uvicorn runs past the limit
    deadlines = {"header_timeout_s": header_timeout_s, "write_timeout_s": write_timeout_s}
    return type("GuardedProtocol", (*before, _HeaderDeadline, _StallDeadline), deadlines)


class _Guard(HttpToolsProtocol):
    """What both guards share: cancelling a timer, and naming the peer they cut."""

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


class _HeaderDeadline(_Guard):
    """Guards against slow headers: a connection whose next request's headers are not
    complete within `header_timeout_s` of its first bytes (or of the connection) is
    closed."""

    header_timeout_s: float
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete
            self._cancel("_header_timer")
        elif self.cycle is None or self.cycle.response_complete:
            self._start_header_timer()  # the first bytes of the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_header_timer")
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._no_headers)

    def _no_headers(self) -> None:
        self._header_timer = None
        log.info(
            "closing %s: no complete request headers within %gs",
            self._peer(),
            self.header_timeout_s,
        )
        self.transport.abort()


class _StallDeadline(_Guard):
    """Guards against a stalled reader: with a `write_timeout_s`, a client that reads
    nothing for that long while a response waits for it is cut, and the kernel's send
    buffer it could hide behind is capped."""

    write_timeout_s: float | None
    _stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.write_timeout_s is not None and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STALL_SEND_BUFFER)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_stall_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timeout_s is not None and self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_stall_timer")

    def _stalled(self) -> None:
        self._stall_timer = None
        log.warning(
            "cutting %s: it read nothing for %gs while a response waited",
            self._peer(),
            self.write_timeout_s,
        )
        self.transport.abort()  # connection_lost → the app sees a disconnect
