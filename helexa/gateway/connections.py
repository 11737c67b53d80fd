"""The gateway's one connection pool to its nodes (an aiohttp session): the proxy, the poller
and the router's loads all call through it. It needs a running event loop, so the service's
`start()` opens it and `stop()` closes it; the objects that use it are built before."""

from __future__ import annotations

import aiohttp

DNS_CACHE_S = 300
CONNECT_TIMEOUT_S = 10


class Connections:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("a call to a node before the gateway's start() or after its stop()")
        return self._session

    async def open(self) -> None:
        """No connection limit (the nodes queue), no total timeout (streams run long), and
        bodies as the node sent them (the gateway reads usage from the bytes it relays)."""
        assert self._session is None, "opened twice"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=DNS_CACHE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
