"""`python bench/floor_proxy.py --port P --node-port N`: the floor of a Python proxy.

bench/gateway.py starts it as its `floor` target, beside the helexa gateway and LiteLLM:
what one more hop through a Python process costs on this machine when the process does
nothing but relay bytes. The same event loop the gateway runs (uvloop) and the same
HTTP parser (httptools); no routing, auth, books, logs or header rewriting: each request
goes to the node on the client connection's own keep-alive connection with its method,
path and body, and the node's answer comes back to the client byte for byte as it
arrives. What the gateway adds past this line is its own work, not the hop's.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import httptools
import uvloop


class _ToNode(asyncio.Protocol):
    """The node's side of one client connection: its answer relayed as it arrives."""

    def __init__(self, client: _FromClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        self.client.send(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _FromClient(asyncio.Protocol):
    """One client connection: each whole request sent on to the node."""

    def __init__(self, node: tuple[str, int]) -> None:
        self.node = node
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: _ToNode | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        method = self.parser.get_method()
        request = b"%s %s HTTP/1.1\r\nhost: node\r\ncontent-type: application/json\r\n" % (
            method,
            self.url,
        )
        request += b"content-length: %d\r\n\r\n%s" % (len(body), body)
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            upstream.transport.write(request)
        else:
            self.connecting = asyncio.ensure_future(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, self.upstream = await loop.create_connection(lambda: _ToNode(self), *self.node)
        except OSError:
            self.close()
            return
        assert self.upstream.transport is not None
        self.upstream.transport.write(request)

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(port: int, node: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _FromClient(node), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node-port", type=int, required=True)
    args = p.parse_args()
    uvloop.run(serve(args.port, ("127.0.0.1", args.node_port)))


if __name__ == "__main__":
    main()
