"""The gateway's own lane for its hot path: the OpenAI pass-through routes (POST
`PASSTHROUGH_PATHS`) answered on the socket, under uvicorn's HTTP protocol but past ASGI.

uvicorn still reads the request (httptools) and keeps the connection: keep-alive,
pipelining, flow control, the header deadline, `limit_concurrency`, graceful shutdown. Every
other route is ASGI as before. For these requests its protocol starts `Lane.serve` in place
of the ASGI app, which does what `GatewayASGI` and the ASGI pass-through did, the same way
(a sane `x-request-id`, CORS, the request counter, the one log line; the same answers and
envelopes), without what cost more than the gateway's own work on an anonymous request:

- no ASGI scope or uvicorn cycle: the request is read into a `LaneCycle` (its path and
  headers as they came, and the state uvicorn's protocol keeps on a cycle);
- no ASGI messages (a dict each, its headers checked again) and no wrapped `send`;
- no task per request waiting for the client's disconnect: the connection's
  `connection_lost` cancels the request's task itself;
- the answer's head leaves with its first body part in one write (a whole answer, or a
  stream that came whole, in one), never held past the loop turn it was made in.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from helexa.errors import HelexaError
from helexa.gateway.exchange import Reply
from helexa.gateway.request_log import RequestRecord
from helexa.logs import request_id
from helexa.protocol.wire import REQUEST_ID_HEADER
from helexa.web.common import envelope
from helexa.web.gateway_asgi import GatewayASGI
from helexa.web.gateway_passthrough import (
    CLIENT_LEFT,
    PASSTHROUGH_PATHS,
    ClientLeft,
    head_headers,
    request_headers,
)

log = logging.getLogger("uvicorn.error")  # where uvicorn logs an app's failure

Headers = list[tuple[bytes, bytes]]
_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")  # what uvicorn refuses in a header value
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_SERVER_ERROR: Headers = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]


class LaneWire:
    """One pass-through request on its connection: its body read from uvicorn's cycle, its
    answer written to the transport (chunked when it has no length)."""

    __slots__ = (
        "answered",
        "chunked",
        "cycle",
        "extra",
        "head",
        "left",
        "loop",
        "protocol",
        "started",
        "status",
        "task",
        "transport",
        "watching",
    )

    def __init__(self, protocol: LaneProtocol, cycle: Any) -> None:
        self.protocol = protocol
        self.cycle = cycle  # uvicorn's RequestResponseCycle: body, keep-alive, completion
        self.transport: asyncio.Transport = protocol.transport
        self.loop = protocol.loop
        self.task: asyncio.Task[None] | None = None
        self.answered = False
        self.left = False
        self.watching = False
        self.started = False
        self.chunked = False
        self.status = 500
        self.head: bytes | None = None  # made, not yet written
        self.extra: Any = None  # (outer, request id, origin, path): the door's headers

    # -- the request -------------------------------------------------------------------
    async def body(self, limit: int) -> bytes | None:
        cycle = self.cycle
        if cycle.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            cycle.waiting_for_100_continue = False
        while cycle.more_body and not cycle.disconnected:
            if len(cycle.body) > limit:
                return None
            self.protocol.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected:
            raise ClientLeft
        body = bytes(cycle.body)
        return body if len(body) <= limit else None

    def watch(self) -> None:
        self.watching = True

    def unwatch(self) -> None:
        self.watching = False

    def client_left(self) -> None:
        """The connection is gone: nothing more is written, and a watched request not yet
        answered is cancelled. (uvicorn tells only the connection's newest cycle, which is
        not this request's when the client pipelined another behind it.)"""
        cycle = self.cycle
        if not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        task = self.task
        if self.watching and not self.answered and task is not None and not task.done():
            self.left = True
            task.cancel()

    # -- the answer --------------------------------------------------------------------
    async def start(self, status: int, headers: Headers) -> None:
        outer, rid, origin, path = self.extra
        self._begin(status, *_lines(outer.response_headers(headers, rid, origin, path)))

    async def reply(self, reply: Reply, length: int | None = None) -> None:
        """The head of a node's answer. A node's headers are the same answer after answer,
        so they are rendered and checked once (`_NODE_HEADS`), and only the request's own
        (its id and length) are added."""
        outer, rid, _, _ = self.extra
        if outer.cors is not None:  # CORS's headers depend on the request's origin
            await self.start(reply.status, head_headers(reply, length))
            return
        key = (reply.status, reply.media_type, *reply.headers.items())
        lines = _NODE_HEADS.get(key)
        if lines is None:
            lines = _lines(head_headers(reply))
            if len(_NODE_HEADS) >= MAX_NODE_HEADS:
                _NODE_HEADS.clear()
            _NODE_HEADS[key] = lines
        text, _, close = lines
        own = b"x-request-id: " + rid + b"\r\n"
        if length is not None:
            own += b"content-length: %d\r\n" % length
        # a whole answer, or a stream whose next part is here, has that part written in
        # this turn, which takes the head along; a stream still waiting gets it now
        held = length is not None or reply.resp.ready
        self._begin(reply.status, text + own, length is not None, close, held)

    def _begin(
        self, status: int, lines: bytes, has_length: bool, close: bool, held: bool = False
    ) -> None:
        """The head made (the status line, uvicorn's date and server headers, `lines`, the
        framing), to go out with the first body part: `held` when one is sure to follow in
        this turn of the loop, else at the end of the turn at the latest."""
        self.status = status
        cycle = self.cycle
        if cycle.disconnected:
            return
        self.started = True
        if close:
            cycle.keep_alive = False
        parts = [
            STATUS_LINE[status],
            _Defaults.of(self.protocol.server_state.default_headers),
            lines,
        ]
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        if not has_length:
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self.head = b"".join(parts)
        if not held:
            self.loop.call_soon(self._flush)  # unless a body part takes it along this turn

    async def send(self, chunk: bytes) -> None:
        if self.protocol.flow.write_paused and not self.cycle.disconnected:
            await self.protocol.flow.drain()
        if self.cycle.disconnected or not chunk:
            return
        self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)

    async def end(self, chunk: bytes = b"") -> None:
        cycle = self.cycle
        if self.protocol.flow.write_paused and not cycle.disconnected:
            await self.protocol.flow.drain()
        if cycle.disconnected:
            return
        if self.chunked:
            chunk = (b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b"") + _LAST_CHUNK
        self._write(chunk)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()  # the next pipelined request, or the keep-alive timer

    async def gone(self) -> None:
        self.status = CLIENT_LEFT  # nobody to write it to: for the log line and the count

    async def error(self, err: HelexaError) -> None:
        status, headers, body = envelope(err)
        await self.start(status, headers)
        await self.end(body)

    def _write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            data = head + data
        self.transport.write(data)

    def _flush(self) -> None:
        if self.head is not None and not self.cycle.disconnected:
            self._write(b"")

    def finish(self) -> None:
        """The request's task is over: an answer never started is uvicorn's plain 500, one
        never finished cuts the connection (as uvicorn does for an ASGI app)."""
        cycle = self.cycle
        cycle.on_response = lambda: None
        if cycle.response_complete or cycle.disconnected:
            return
        if not self.started:
            self.status = 500
            self.transport.write(
                b"".join([STATUS_LINE[500], *(n + b": " + v + b"\r\n" for n, v in _SERVER_ERROR)])
                + b"\r\nInternal Server Error"
            )
        self._flush()
        self.transport.close()


MAX_NODE_HEADS = 256  # distinct node heads kept rendered (nodes × models × kinds of answer)
_NODE_HEADS: dict[tuple[Any, ...], tuple[bytes, bool, bool]] = {}


def _lines(headers: Headers) -> tuple[bytes, bool, bool]:
    """Headers as head lines, each value checked as uvicorn checks it; whether they give the
    body's length, and whether they close the connection (said once, by the framing)."""
    parts: list[bytes] = []
    has_length = close = False
    for name, value in headers:
        if _VALUE.search(value):
            raise RuntimeError(f"header {name!r} holds a control character")
        if name == b"content-length":
            has_length = True
        elif name == b"connection" and b"close" in value.lower():
            close = True
            continue
        parts += (name, b": ", value, b"\r\n")
    return b"".join(parts), has_length, close


class _Defaults:
    """uvicorn's default headers (its date and server), rendered once for each list of them
    (it makes a new one every second)."""

    source: list[tuple[bytes, bytes]] | None = None
    text = b""

    @classmethod
    def of(cls, headers: list[tuple[bytes, bytes]]) -> bytes:
        if cls.source is not headers:
            cls.source, cls.text = headers, b"".join(n + b": " + v + b"\r\n" for n, v in headers)
        return cls.text


class Lane:
    """Serves the pass-through routes on a `LaneProtocol` connection: the door's work of
    `GatewayASGI` (`outer`) around its pass-through's `serve`."""

    def __init__(self, outer: GatewayASGI) -> None:
        self.outer = outer
        self.passthrough = outer.passthrough

    async def serve(self, wire: LaneWire) -> None:
        cycle = wire.cycle
        path = cycle.path
        headers = request_headers(cycle.headers)
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        headers[REQUEST_ID_HEADER] = rid  # the node sees the sane id, never the client's raw one
        record = RequestRecord(rid)
        wire.extra = (self.outer, rid.encode(), headers.get("origin"), path)
        try:
            await self.passthrough.serve(wire, path, headers, record)
        except asyncio.CancelledError:
            raise  # the server's own (its shutdown's): the connection goes with it
        except Exception as exc:
            log.error("Exception in the gateway's lane\n", exc_info=exc)
        finally:
            wire.finish()
            self.outer.count(path, "POST", wire.status, record)


class LaneCycle:
    """A lane request on its connection, read without an ASGI scope: its path and headers,
    and the state uvicorn's protocol reads and sets on its own cycle under these names (its
    body, pipelining, flow control, keep-alive timer, disconnect and drain work on it as
    they do on an ASGI request)."""

    __slots__ = (
        "body",
        "disconnected",
        "headers",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "path",
        "response_complete",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        path: str,
        headers: Headers,
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Any,
    ) -> None:
        self.path = path
        self.headers = headers  # (lower-case name, value) as they came
        self.waiting_for_100_continue = expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = on_response  # the next pipelined request, or the keep-alive timer
        self.message_event = asyncio.Event()
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_complete = False


_TARGETS = {p.encode(): p for p in PASSTHROUGH_PATHS}  # a lane request's whole target


class LaneProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the lane (set on a subclass, `lane_protocol`): a POST to a
    pass-through path is read into a `LaneCycle` and served by `lane` past ASGI; the rest
    (and a lane request past `limit_concurrency`, for its 503) as uvicorn runs them, their
    ASGI scope made only for them."""

    lane: Lane | None = None
    _lane_wire: LaneWire | None = None

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None  # type: ignore[assignment]  # made in on_headers_complete if needed

    def on_headers_complete(self) -> None:
        parser = self.parser
        path = _TARGETS.get(self.url)
        if (
            path is None
            or self.lane is None
            or parser.get_method() != b"POST"
            or parser.should_upgrade()
            or self._over_limit()
        ):
            self._make_scope()
            super().on_headers_complete()
            return
        existing = self.cycle
        cycle = self.cycle = LaneCycle(  # type: ignore[assignment]
            path,
            self.headers,
            self.expect_100_continue,
            parser.get_http_version() != "1.0" and parser.should_keep_alive(),
            self.on_response_complete,
        )
        if existing is None or existing.response_complete:
            self._start_lane(cycle)
        else:  # pipelined behind a request not yet answered
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]

    def _over_limit(self) -> bool:
        limit = self.limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def _make_scope(self) -> None:
        """uvicorn's ASGI scope for this request, as its `on_message_begin` makes it."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, LaneCycle):  # a pipelined lane request's turn
            self._start_lane(cycle)
        else:
            super()._start_asgi_task(cycle, app)

    def _start_lane(self, cycle: LaneCycle) -> None:
        assert self.lane is not None
        wire = self._lane_wire = LaneWire(self, cycle)
        task = wire.task = self.loop.create_task(self.lane.serve(wire))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)  # a graceful shutdown waits for it

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        wire = self._lane_wire
        if wire is not None:
            self._lane_wire = None
            wire.client_left()


def lane_protocol(lane: Lane) -> type[LaneProtocol]:
    """The mixin `helexa.web.server.serve` puts in front of its guarded protocol."""
    return type("GatewayLaneProtocol", (LaneProtocol,), {"lane": lane})
