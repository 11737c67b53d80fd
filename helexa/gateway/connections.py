"""The gateway's connections to its nodes: the proxy's exchanges over its own keep-alive
pool (`node_http.NodePool`), and everything else (the poller, the router's loads, a cut
exchange's usage) through one aiohttp session. They need a running event loop, so the
service's `start()` opens them and `stop()` closes them; the objects that use them are
built before."""

from __future__ import annotations

import aiohttp

from helexa.gateway.node_http import NodePool

DNS_CACHE_S = 300
CONNECT_TIMEOUT_S = 10


class Connections:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._pool: NodePool | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("a call to a node before the gateway's start() or after its stop()")
        return self._session

    @property
    def pool(self) -> NodePool:
        if self._pool is None:
            raise RuntimeError("a call to a node before the gateway's start() or after its stop()")
        return self._pool

    async def open(self) -> None:
        """No connection limit (the nodes queue), no total timeout (streams run long), and
        bodies as the node sent them (the gateway reads usage from the bytes it relays)."""
        assert self._session is None, "opened twice"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=DNS_CACHE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            auto_decompress=False,
        )
        self._pool = NodePool()

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None
