"""Keeps what the gateway knows fresh, every `poll_interval_s`.

The fleet: `/discovery` once per node (again while its prompt cap is unknown), `/models` and
`/health` every interval. A node that stops answering leaves routing at once and comes back
the moment it answers again.

The database it shares with other gateways (`DatabaseSync`, run by the poller): the
catalogue and aliases are re-read and the key cache dropped, so an edit made through
another gateway or `helexa keys` reaches this one within an interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
from sqlalchemy.orm import Session, sessionmaker

from helexa.gateway.auth import Authenticator
from helexa.gateway.catalogue_edit import catalogue_rows
from helexa.gateway.connections import Connections
from helexa.gateway.fleet import KEY_REFUSED, NOT_ANSWERING, Fleet, NodeView
from helexa.gateway.router import Router

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 5.0
KEY_HINT = "check its [[nodes]] api_key / api_key_env against the node's [node] api_key"


class Poller:
    def __init__(self, fleet: Fleet, connections: Connections, interval_s: float) -> None:
        self.fleet = fleet
        self.connections = connections
        self.interval_s = interval_s
        self._also: list[Callable[[], Awaitable[None]]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def also_every_interval(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run `work` every interval too, from start() to stop(); it handles its own errors."""
        self._also.append(work)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(node), name=f"poll-{node.name}")
            for node in self.fleet.nodes.values()
        ]
        self._tasks += [
            asyncio.create_task(self._every(work), name="poll-db") for work in self._also
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def refresh(self, node: NodeView) -> None:
        """Poll `node` now (after a load or unload the gateway itself asked for)."""
        await self.poll_once(node)

    async def _run(self, node: NodeView) -> None:
        while True:
            await self.poll_once(node)
            await asyncio.sleep(self.interval_s)

    async def _every(self, work: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # the gateway was built from fresh reads
            await work()

    async def poll_once(self, node: NodeView) -> None:
        try:
            if node.discovery is None or node.max_prompt_tokens is None:
                node.discovery = await self._get(node, "/discovery")
            node.poll_started()
            models, health = await asyncio.gather(
                self._get(node, "/models"), self._get(node, "/health")
            )
            if not isinstance(models, list) or not isinstance(health, dict):
                raise ValueError("unexpected /models or /health shape")
            was_up = node.up
            node.mark_up(models, health)
            if not was_up:
                log.info("node %s is up (%d models loaded)", node.name, len(node.models))
            for model_id, entry in node.models.items():
                if entry.get("status") == "loaded" and model_id not in node.endpoints:
                    found = await self._get(node, f"/models/{quote(model_id, safe='/')}/endpoint")
                    if isinstance(found, dict) and isinstance(found.get("endpoint"), str):
                        node.endpoints[model_id] = found["endpoint"]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error, reason = describe_error(e), NOT_ANSWERING
            if isinstance(e, aiohttp.ClientResponseError) and e.status == 401:
                error, reason = f"it refused the gateway's api_key (401): {KEY_HINT}", KEY_REFUSED
            if node.up or node.last_error is None:
                log.warning("node %s stopped answering (%s); it leaves routing", node.name, error)
            node.mark_down(error, reason)

    async def _get(self, node: NodeView, path: str) -> Any:
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
        async with self.connections.session.get(
            node.endpoint + path, timeout=timeout, headers=node.auth_headers()
        ) as r:
            r.raise_for_status()
            return await r.json(content_type=None)


def describe_error(e: BaseException) -> str:
    """An exception in one log-friendly line: its type, and its message if it has one."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class DatabaseSync:
    """What this gateway holds in memory from its shared database, brought up to date:
    `refresh` (every poll interval) re-reads the catalogue and aliases in a thread and drops
    the key cache. While the database cannot be read the router keeps the catalogue it has,
    and that is logged once."""

    def __init__(
        self, sessions: sessionmaker[Session], router: Router, auth: Authenticator
    ) -> None:
        self.sessions = sessions
        self.router = router
        self.auth = auth
        self.failing = False

    async def refresh(self) -> None:
        self.auth.forget()
        generation = self.router.catalogue_generation
        try:
            models, aliases = await asyncio.to_thread(catalogue_rows, self.sessions)
        except Exception as e:
            if not self.failing:
                log.warning(
                    "could not re-read the catalogue from the database (%s); routing by the "
                    "one read before until it can",
                    describe_error(e),
                )
            self.failing = True
            return
        if self.failing:
            log.info("the catalogue is read from the database again")
            self.failing = False
        if generation != self.router.catalogue_generation:
            return  # an edit made here replaced it while we read; the next refresh checks
        if not self.router.routes_by(models, aliases):
            self.router.replace_catalogue(models, aliases)
            log.info(
                "catalogue changed in the database: %d models, %d aliases",
                len(models),
                len(aliases),
            )


LOAD_TIMEOUT_S = 3600.0  # a cold load may fetch and place tens of GB


class NodeCalls:
    """The node management calls the router makes (load, unload) and a poll on demand.

    What a failure says is for clients and the admin console: the node's name, never the
    wire detail (addresses, exception text), which goes to the log."""

    def __init__(self, connections: Connections, poller: Poller) -> None:
        self.connections = connections
        self.poller = poller

    async def load(self, node: NodeView, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)
        try:
            async with self.connections.session.post(
                node.endpoint + "/models/load",
                json=body,
                timeout=timeout,
                headers=node.auth_headers(),
            ) as r:
                if r.status == 401:
                    log.warning("loading on %s: 401; %s", node.name, KEY_HINT)
                    return 503, refused(node)
                return r.status, await _json_or_empty(r)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("loading on %s failed: %s", node.name, describe_error(e))
            node.mark_down(describe_error(e))
            return 503, unreachable(node)

    async def unload(self, node: NodeView, model_id: str) -> int:
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S * 12)
        try:
            async with self.connections.session.post(
                node.endpoint + "/models/unload",
                json={"model_id": model_id},
                timeout=timeout,
                headers=node.auth_headers(),
            ) as r:
                if r.status == 401:
                    log.warning("unloading on %s: 401; %s", node.name, KEY_HINT)
                return r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("unloading %s from %s failed: %s", model_id, node.name, describe_error(e))
            return 503

    async def refresh(self, node: NodeView) -> None:
        await self.poller.refresh(node)


def unreachable(node: NodeView) -> dict[str, Any]:
    """The error a failed call to `node` shows: generic, the detail is in the log."""
    message = f"node {node.name} could not be reached; retry shortly"
    return {"error": {"message": message, "code": "service_unavailable"}}


def refused(node: NodeView) -> dict[str, Any]:
    message = f"node {node.name} did not accept the gateway's credentials; retry shortly"
    return {"error": {"message": message, "code": "service_unavailable"}}


async def _json_or_empty(r: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        value = await r.json(content_type=None)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
