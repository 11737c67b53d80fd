"""The proxy's HTTP/1.1 client to its nodes: one POST per exchange over pooled keep-alive
connections, its answer read as it arrives (httptools, uvicorn's C parser, for both the
head and the body, chunked or sized).

aiohttp's client did the same work with a general client's machinery around it (request
and response objects, URL parsing, cookie jars, trace hooks, per-request timers), which
cost the gateway more than a third of its CPU per proxied request. The rest of the
gateway's calls to nodes (polls, loads, a cut exchange's usage) stay on aiohttp: they are
rare. Failures are aiohttp's exception types, so the proxy tells them apart as before: a
connection that cannot be made or breaks before any answer is `ClientConnectionError`,
an answer that breaks off is `ClientPayloadError`, and a node silent for the idle timeout
while answering is `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

CONNECT_TIMEOUT_S = 10.0
HIGH_WATER = 256 << 10  # answer bytes buffered for a slow client before the node is paused
IDLE_KEEP_S = 15.0  # a pooled connection idle this long is closed rather than reused


class _Connection(asyncio.Protocol):
    """One connection to a node, carrying one exchange at a time."""

    def __init__(self, pool: NodePool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.response: NodeResponse | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.lost = False
        # the idle deadline of its answers: one timer per connection, re-armed only when
        # it fires (or for an answer due sooner), not one made and cancelled per answer
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    # -- the transport's callbacks --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        response.last_read = self.loop.time()
        response.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response.fail(aiohttp.ClientPayloadError("the node upgraded the connection"))
            self.close()
        except httptools.HttpParserError as e:
            response.fail(aiohttp.ClientPayloadError(f"the node's answer is not HTTP: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        response = self.response
        if response is not None and not response.complete:
            if not response.received:
                error: Exception = aiohttp.ServerDisconnectedError()
            else:
                error = aiohttp.ClientPayloadError("the node's answer broke off")
            response.fail(error)

    def pause_writing(self) -> None:  # request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools' callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the
            response.raw_headers.clear()  # answer proper comes after it
            response.interim = True
            return
        response.status = status
        if not response.head.done():
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.push(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if response.interim:
            response.interim = False
            return
        response.ended(self.parser.should_keep_alive())

    # -- the answer's idle deadline -------------------------------------------------------
    def watch(self, response: NodeResponse) -> None:
        """Cut `response` when its node is silent for its idle timeout."""
        due = response.last_read + response.idle_timeout_s
        if self._timer is None or due < self._due:
            if self._timer is not None:
                self._timer.cancel()
            self._due = due
            self._timer = self.loop.call_at(due, self._idle_check)

    def _idle_check(self) -> None:
        self._timer = None
        response = self.response
        if response is None or response.complete or response.error is not None:
            return  # nothing waits on the node now: the next answer arms it again
        now = self.loop.time()
        if response.paused:  # the client is slow, not the node
            response.last_read = now
        due = response.last_read + response.idle_timeout_s
        if due > now:
            self._due = due
            self._timer = self.loop.call_at(due, self._idle_check)
            return
        response.fail(TimeoutError(f"the node sent nothing for {response.idle_timeout_s:g}s"))
        self.close()

    # -- the pool's side -------------------------------------------------------------------
    def usable(self, now: float) -> bool:
        transport = self.transport
        return (
            not self.lost
            and transport is not None
            and not transport.is_closing()
            and now - self.idle_since < IDLE_KEEP_S
        )

    def close(self) -> None:
        self.lost = True
        self.pool.forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()


class NodeResponse:
    """A node's answer: its status and headers once its head has come, then its body,
    whole (`read`) or part by part as it comes (`part`). `release` hands a wholly read
    connection back to the pool; `close` drops it (and so the node's request). A node
    silent for `idle_timeout_s` while answering (not counting while a slow client holds
    its bytes back) fails it with TimeoutError (`_Connection.watch`)."""

    def __init__(self, conn: _Connection, idle_timeout_s: float) -> None:
        loop = conn.loop
        self.conn = conn
        self.idle_timeout_s = idle_timeout_s
        self.status = 0
        self.raw_headers: list[tuple[str, str]] = []  # as they came, names as the node wrote them
        self._headers: CIMultiDictProxy[str] | None = None
        self.head: asyncio.Future[None] = loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.interim = False  # parsing an interim (1xx) answer
        self.error: BaseException | None = None
        self.last_read = loop.time()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The head's headers, case-blind (made when first asked for: the proxy's hot path
        reads `raw_headers` once instead)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(self.raw_headers))
        return self._headers

    # -- filled by the connection -------------------------------------------------------------
    def push(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.conn.transport is not None:
            self.paused = True
            self.conn.transport.pause_reading()
        self.wake()

    def ended(self, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        self.wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved here: `_send` re-raises it where awaited
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the exchange -----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether `part` would return now, without waiting for the node."""
        return bool(self.chunks) or self.complete or self.error is not None

    async def part(self) -> bytes | None:
        """The body bytes that have come since the last call (waiting for some); None at
        its end. What arrived together is relayed together: one write to the client."""
        while True:
            if self.chunks:
                chunks = self.chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                if self.paused and self.conn.transport is not None:  # drained: below any mark
                    self.paused = False
                    self.last_read = self.conn.loop.time()
                    self.conn.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            waiter = self._waiter = self.conn.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def iter_any(self) -> AsyncIterator[bytes]:
        while (chunk := await self.part()) is not None:
            yield chunk

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.part()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: a wholly read one's connection goes back to the pool."""
        if self._done:
            return
        self._done = True
        conn = self.conn
        conn.response = None
        if self.complete and self.keep_alive and self.error is None and not conn.lost:
            conn.pool.give_back(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection, whatever was read: the node sees its client leave."""
        if self._done:
            return
        self._done = True
        self.conn.response = None
        self.conn.close()


class NodePool:
    """Keep-alive connections to the nodes, by (scheme, host, port)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], idle_timeout_s: float
    ) -> NodeResponse:
        """POST `body` to `url` and wait for the answer's head. A reused connection that the
        node had closed (no byte of an answer came back) is retried once on a new one."""
        scheme, host, port, target = _split(url)
        key = (scheme, host, port)
        head = _request_head(target, host, port, headers, len(body))
        conn = self._reusable(key)
        if conn is not None:
            try:
                return await self._send(conn, head, body, idle_timeout_s)
            except aiohttp.ServerDisconnectedError:
                pass  # closed while idle: the node never saw this request
        conn = await self._connect(key)
        return await self._send(conn, head, body, idle_timeout_s)

    async def _send(
        self, conn: _Connection, head: bytes, body: bytes, idle_timeout_s: float
    ) -> NodeResponse:
        response = NodeResponse(conn, idle_timeout_s)
        conn.response = response
        conn.parser = httptools.HttpResponseParser(conn)
        conn.watch(response)
        assert conn.transport is not None
        conn.transport.write(head + body)
        try:
            await response.head
        except BaseException:
            response.close()
            raise
        return response

    def _reusable(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        if self._closed:
            raise RuntimeError("a call to a node after the gateway's stop()")
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=context
                )
        except OSError as e:
            raise aiohttp.ClientOSError(e.errno, f"cannot connect to {host}:{port}: {e}") from e
        return conn

    def give_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        self._closed = True
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()


@functools.lru_cache(maxsize=1024)  # a handful of distinct URLs, each split on every request
def _split(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise aiohttp.InvalidURL(url)
    port = parts.port or (443 if scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return scheme, parts.hostname, port, target


def _request_head(
    target: str, host: str, port: int, headers: Mapping[str, str], length: int
) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
    lines = [f"POST {target} HTTP/1.1", f"Host: {authority}", f"Content-Length: {length}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
