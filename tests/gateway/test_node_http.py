"""The proxy's own HTTP client to its nodes (`helexa.gateway.node_http`), against servers
on loopback sockets that answer as a node does, and as a failing one does: sized and
chunked answers, keep-alive reuse, a pooled connection the node closed while idle, answers
that break off, a node that goes silent, a refused connection, and backpressure."""

from __future__ import annotations

import asyncio
import functools
import re
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from helexa.gateway import node_http
from helexa.gateway.node_http import NodePool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request's head and body off the connection; None when the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def _sized(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"X-Node: yes\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Server:
    """A loopback server whose connections are served by `handler`, counted."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1") -> None:
        self.handler = handler
        self.host = host
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader, writer):
            self.connections += 1
            try:
                await self.handler(reader, writer)
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, self.host, 0)
        port = self.server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()


def run(main):
    return asyncio.run(asyncio.wait_for(main(), 30))


async def _echo_forever(reader, writer, before: bytes = b""):
    """A keep-alive node: every request answered with its own body (after `before`)."""
    while (got := await _request(reader)) is not None:
        writer.write(before + _sized(got[1]))
        await writer.drain()


def test_sized_answers_come_whole_and_one_connection_carries_them_all():
    async def main():
        server = Server(_echo_forever)
        async with server as url:
            pool = NodePool()
            answers = []
            for i in range(5):
                resp = await pool.post(url + "/v1/x?a=1", b'{"n":%d}' % i, {"X-Mine": "1"}, 10)
                assert (resp.status, resp.headers["content-type"]) == (200, "application/json")
                assert resp.headers["X-NODE"] == "yes"  # any case
                answers.append(await resp.read())
                resp.release()
            pool.close()
            return answers, server.connections

    answers, connections = run(main)
    assert answers == [b'{"n":%d}' % i for i in range(5)]
    assert connections == 1


def test_interim_answers_before_the_answer_are_passed_over():
    """A node may send `100 Continue` or `103 Early Hints` before its answer: the answer is
    what comes after them, on a connection that still carries the next exchange."""

    interim = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    )

    async def main():
        server = Server(functools.partial(_echo_forever, before=interim))
        async with server as url:
            pool = NodePool()
            seen = []
            for i in range(2):
                resp = await pool.post(url + "/v1/x", b'{"n":%d}' % i, {}, 10)
                seen.append((resp.status, "link" in resp.headers, await resp.read()))
                resp.release()
            pool.close()
            return seen, server.connections

    seen, connections = run(main)
    assert seen == [(200, False, b'{"n":0}'), (200, False, b'{"n":1}')]
    assert connections == 1


def test_a_node_on_an_ipv6_address_gets_a_bracketed_host_header():
    heads = []

    async def main():
        async def note(reader, writer):
            got = await _request(reader)
            heads.append(got[0])
            writer.write(_sized(b"ok"))
            await writer.drain()

        async with Server(note, "::1") as url:
            pool = NodePool()
            resp = await pool.post(url + "/x", b"{}", {}, 10)
            body = await resp.read()
            resp.release()
            pool.close()
            return body

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert run(main) == b"ok"
    assert re.search(rb"\r\nHost: \[::1\]:\d+\r\n", heads[0])


def test_a_chunked_stream_is_relayed_as_it_comes_not_at_its_end():
    async def main():
        second = asyncio.Event()

        async def stream(reader, writer):
            await _request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b"data: 1\n\n")
            )
            await writer.drain()
            await second.wait()  # the client must have read the first event by now
            writer.write(_chunk(b"data: 2\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            await _request(reader)

        async with Server(stream) as url:
            pool = NodePool()
            resp = await pool.post(url + "/s", b"{}", {}, 10)
            got = []
            async for chunk in resp.iter_any():
                got.append(chunk)
                second.set()
            resp.release()
            pool.close()
            return got

    got = run(main)
    assert got[0] == b"data: 1\n\n"
    assert b"".join(got) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def _two_posts(server: Server, pause_s: float = 0.0) -> tuple[bytes, int]:
    """Two requests one after the other, the first's connection pooled between them: the
    second's answer, and how many connections the server saw."""
    async with server as url:
        pool = NodePool()
        first = await pool.post(url + "/a", b"1", {}, 10)
        assert await first.read() == b"1"
        first.release()  # pooled: keep-alive was not refused
        await asyncio.sleep(pause_s)
        second = await pool.post(url + "/a", b"2", {}, 10)
        body = await second.read()
        second.release()
        pool.close()
        return body, server.connections


def test_a_pooled_connection_the_node_closed_while_idle_is_replaced_not_failed():
    async def main():
        async def once(reader, writer):  # answers one request, then closes (idle timeout)
            got = await _request(reader)
            writer.write(_sized(got[1]))
            await writer.drain()

        return await _two_posts(Server(once), pause_s=0.2)  # the server closes it meanwhile

    assert run(main) == (b"2", 2)


def test_a_request_on_a_pooled_connection_the_node_drops_unanswered_is_sent_again():
    """The race a keep-alive pool lives with: the node closes an idle connection just as a
    request goes out on it. No byte of an answer came, so the node never took it: it is
    sent once more, on a new connection."""

    async def main():
        server: Server

        async def first_then_drop(reader, writer):
            if server.connections > 1:
                await _echo_forever(reader, writer)
                return
            got = await _request(reader)
            writer.write(_sized(got[1]))
            await writer.drain()
            await _request(reader)  # the next request arrives... and is dropped unanswered

        server = Server(first_then_drop)
        return await _two_posts(server)

    assert run(main) == (b"2", 2)


def test_a_node_that_closes_mid_answer_or_before_it_fails_as_such():
    async def main():
        async def broken(reader, writer):
            got = await _request(reader)
            if got[1] == b"mid":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
                await writer.drain()
            # else: closes before any answer

        async with Server(broken) as url:
            pool = NodePool()
            resp = await pool.post(url + "/m", b"mid", {}, 10)
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            resp.close()
            with pytest.raises(aiohttp.ClientConnectionError):
                await pool.post(url + "/m", b"none", {}, 10)
            pool.close()

    run(main)


def test_a_node_silent_past_the_idle_timeout_is_cut():
    async def main():
        closed = asyncio.Event()

        async def silent(reader, writer):
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"x"))
            await writer.drain()
            await reader.read()  # until the client cuts the connection
            closed.set()

        async with Server(silent) as url:
            pool = NodePool()
            resp = await pool.post(url + "/q", b"{}", {}, 0.3)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                async for _ in resp.iter_any():
                    pass
            waited = asyncio.get_running_loop().time() - started
            await asyncio.wait_for(closed.wait(), 5)  # the node saw its client leave
            resp.close()
            pool.close()
            return waited

    assert 0.25 < run(main) < 3


def test_the_idle_deadline_follows_each_answer_on_a_reused_connection():
    """One connection's answers share its timer: an answer with a shorter timeout than the
    one before it is still cut on time, and a quick answer after a slow start is not cut."""

    async def main():
        async def node(reader, writer):
            await _request(reader)  # the first: answered at once
            writer.write(_sized(b"first"))
            await writer.drain()
            await _request(reader)  # the second: its head, then silence
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"x"))
            await writer.drain()
            await reader.read()

        async with Server(node) as url:
            pool = NodePool()
            resp = await pool.post(url + "/a", b"{}", {}, 600)
            assert await resp.read() == b"first"
            resp.release()
            resp = await pool.post(url + "/b", b"{}", {}, 0.3)  # the same connection
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError):
                await resp.read()
            waited = loop.time() - started
            resp.close()
            pool.close()
            return waited

    assert 0.25 < run(main) < 3


def test_a_refused_connection_is_a_connection_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = NodePool()
        with pytest.raises(aiohttp.ClientConnectionError):
            await pool.post(f"http://127.0.0.1:{port}/x", b"{}", {}, 10)
        pool.close()

    run(main)


def test_a_header_with_a_line_break_is_never_sent():
    async def main():
        async with Server(_echo_forever) as url:
            pool = NodePool()
            with pytest.raises(ValueError, match="line break"):
                await pool.post(url + "/x", b"{}", {"X-Bad": "a\r\nInjected: 1"}, 10)
            pool.close()

    run(main)


def test_a_client_slower_than_its_node_pauses_the_node_not_the_memory(monkeypatch):
    monkeypatch.setattr(node_http, "HIGH_WATER", 64 << 10)
    piece = b"y" * (16 << 10)

    async def main():
        async def flood(reader, writer):
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(64):  # 1 MiB
                writer.write(_chunk(piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await _request(reader)

        async with Server(flood) as url:
            pool = NodePool()
            resp = await pool.post(url + "/f", b"{}", {}, 10)
            await asyncio.sleep(0.5)  # nobody reads: the node is paused, not buffered
            paused, buffered = resp.paused, resp.buffered
            total = len(await resp.read())
            resp.release()
            pool.close()
            return paused, buffered, total

    paused, buffered, total = run(main)
    assert paused
    assert buffered < 256 << 10  # the high water mark plus what one read brought
    assert total == 64 * len(piece)
