"""Keeps the fleet picture fresh: `/discovery` once per node (again while its prompt cap is
unknown), `/models` and `/health` every `poll_interval_s`. A node that stops answering
leaves routing at once and comes back the moment it answers again."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import aiohttp

from helexa.gateway.connections import Connections
from helexa.gateway.fleet import KEY_REFUSED, NOT_ANSWERING, Fleet, NodeView

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 5.0
KEY_HINT = "check its [[nodes]] api_key / api_key_env against the node's [node] api_key"


class Poller:
    def __init__(self, fleet: Fleet, connections: Connections, interval_s: float) -> None:
        self.fleet = fleet
        self.connections = connections
        self.interval_s = interval_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(node), name=f"poll-{node.name}")
            for node in self.fleet.nodes.values()
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

    async def poll_once(self, node: NodeView) -> None:
        try:
            if node.discovery is None or node.max_prompt_tokens is None:
                node.discovery = await self._get(node, "/discovery")
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
