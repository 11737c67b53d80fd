"""`python bench/floor_proxy.py --port P --node-port N [--asgi]`: the floors of a Python proxy.

bench/gateway.py starts it as its `floor` and `floor-asgi` targets, beside the helexa
gateway and LiteLLM, so that what the gateway adds is read against what any Python proxy
here costs:

- `floor`: one more hop through a process that does nothing but relay bytes, on the event
  loop the gateway runs (uvloop) and its HTTP parser (httptools). No routing, auth, books,
  logs or header rewriting: each request goes to the node on the client connection's own
  keep-alive connection with its method, path and body, and the node's answer comes back
  byte for byte as it arrives.
- `floor-asgi` (`--asgi`): the same relay as an ASGI app under uvicorn (the server the
  gateway runs, with its httptools protocol), through the gateway's own node client
  (`helexa.gateway.node_http`). What it adds past `floor` is the server and ASGI layer;
  what the gateway adds past it is the gateway's own work. GETs (the bench's readiness
  check) are answered with the model list here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # helexa, from a checkout


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
        self.connecting: asyncio.Task[None] | None = None  # held: the loop keeps weak refs
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


MODELS = b'{"object":"list","data":[{"id":"fake-model","object":"model"}]}'
JSON = [(b"content-type", b"application/json")]
NODE_HEADERS = {"content-type": "application/json"}


def asgi_relay(node: str) -> Callable[..., Awaitable[None]]:
    """The ASGI app of `--asgi`: each POST sent on through the gateway's node client, its
    answer relayed chunk by chunk as it arrives."""
    from helexa.gateway.node_http import NodePool

    pool = NodePool()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = (await receive()).get("body", b"")
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": JSON})
            await send({"type": "http.response.body", "body": MODELS})
            return
        resp = await pool.post(node + scope["path"], body, NODE_HEADERS, 60.0)
        kind = resp.headers.get("Content-Type", "application/json").encode()
        headers = [(b"content-type", kind)]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        async for chunk in resp.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        resp.release()
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node-port", type=int, required=True)
    p.add_argument("--asgi", action="store_true", help="an ASGI app under uvicorn")
    args = p.parse_args()
    if args.asgi:
        import uvicorn

        app = asgi_relay(f"http://127.0.0.1:{args.node_port}")
        uvicorn.run(
            app, host="127.0.0.1", port=args.port, http="httptools", loop="uvloop",
            log_level="warning", access_log=False,
        )  # fmt: skip
        return
    uvloop.run(serve(args.port, ("127.0.0.1", args.node_port)))


if __name__ == "__main__":
    main()
