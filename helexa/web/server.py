"""Run a Litestar app under uvicorn with helexa's shutdown contract: on SIGTERM/SIGINT stop
accepting, let in-flight responses finish within `drain_timeout_s`, run the app's shutdown
(unload models, flush state), and exit 0 rather than die by the signal. Under systemd
(`Type=notify`) it says READY=1 once every listener is bound and `ready` has returned, and
STOPPING=1 when a signal starts the drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Generator, Sequence
from types import FrameType

import uvicorn
from litestar.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from helexa.config import HttpConfig
from helexa.systemd import notify
from helexa.web.connection_guard import guarded_protocol

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        on_exit: Callable[[], None] | None,
        ready: Callable[[], Awaitable[str | None]] | None = None,
        companions: Sequence[uvicorn.Server] = (),
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._ready = ready
        self._companions = companions  # listeners that must be bound before READY=1
        self._announcing: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._announcing = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        """READY=1 once the companions' listeners are bound too and `ready` has returned,
        with its line as STATUS=."""
        while not all(c.started for c in self._companions):
            if self.should_exit:
                return
            await asyncio.sleep(0.05)
        status = await self._ready() if self._ready is not None else None
        if not self.should_exit:
            notify("READY=1", *([f"STATUS={status}"] if status else []))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._announcing is not None:
            self._announcing.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("%s: draining in-flight requests", signal.Signals(sig).name)
            notify("STOPPING=1", "STATUS=draining in-flight requests")
        super().handle_exit(sig, frame)
        # The drain was the graceful answer to the signal: exit 0, not re-raise it.
        self._captured_signals.clear()
        if self._on_exit is not None:
            self._on_exit()


class _Companion(uvicorn.Server):
    """A second listener in the same process (the gateway's metrics port): it leaves the
    signals to the main server and stops when that one does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def serve(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    drain_timeout_s: float,
    http: HttpConfig | None = None,
    write_timeout_s: float | None = None,
    on_exit: Callable[[], None] | None = None,
    companions: list[tuple[ASGIApp, str, int]] | None = None,
    ready: Callable[[], Awaitable[str | None]] | None = None,
    protocol: type[HttpToolsProtocol] | None = None,
) -> int:
    """Serve until a signal; returns the process exit code. `http` sets the connection
    limits; `write_timeout_s` cuts a client that reads nothing for that long; `ready`,
    awaited once every listener is bound, says when (and with what status line) to tell
    systemd READY=1; `protocol`, a subclass of uvicorn's, goes in front of the guards on
    the main listener (the gateway's lane)."""
    http = http or HttpConfig()
    others = [_Companion(_config(a, h, p, 1.0, http, None)) for a, h, p in companions or []]
    before = (protocol,) if protocol is not None else ()
    config = _config(app, host, port, drain_timeout_s, http, write_timeout_s, before)
    main = _Server(config, on_exit, ready, others)
    if not others:
        main.run()
        return 0 if main.started else 1

    async def run_all() -> None:
        tasks = [asyncio.create_task(s.serve()) for s in others]
        try:
            await main.serve()
        finally:
            for s in others:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - not on Windows
        asyncio.run(run_all())
    else:
        uvloop.run(run_all())
    return 0 if main.started and all(s.started for s in others) else 1


def _config(
    app: ASGIApp,
    host: str,
    port: int,
    drain_timeout_s: float,
    http: HttpConfig,
    write_timeout_s: float | None,
    before: tuple[type[HttpToolsProtocol], ...] = (),
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(http.header_timeout_s, write_timeout_s, before),
        log_config=None,  # helexa configures logging once, in the CLI
        access_log=False,
        timeout_graceful_shutdown=max(1, round(drain_timeout_s)),
        timeout_keep_alive=max(1, round(http.keep_alive_timeout_s)),
        limit_concurrency=http.limit_concurrency,
        lifespan="on",
    )
