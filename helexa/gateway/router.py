"""Which node serves a request: aliases, least-busy replicas, cold loads with eviction.

No HTTP in the decisions; the node calls it needs (load, unload) go through `NodeClient`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from helexa.config import Config, ModelEntry
from helexa.errors import model_not_found, service_unavailable
from helexa.gateway.fleet import Fleet, NodeView
from helexa.logs import event

log = logging.getLogger(__name__)

NO_NODE_RETRY_AFTER_S = 5.0
RECOVERING_RETRY_AFTER_S = 2.0
LOAD_FAILED_RETRY_AFTER_S = 30.0


class NodeClient(Protocol):
    async def load(self, node: NodeView, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...

    async def unload(self, node: NodeView, model_id: str) -> int: ...

    async def refresh(self, node: NodeView) -> None: ...


@dataclass(slots=True)  # (not frozen: made on every request, and a frozen one costs 2x)
class Route:
    """Where one request goes: the node, the model id the node knows, its base URL."""

    node: NodeView
    model_id: str
    base_url: str


class Router:
    def __init__(self, cfg: Config, fleet: Fleet, nodes: NodeClient) -> None:
        self.fleet = fleet
        self.nodes = nodes
        self.catalogue: dict[str, ModelEntry] = {}
        self.aliases: dict[str, str] = {}
        self.catalogue_generation = 0  # one more on every replace_catalogue
        self.replace_catalogue(cfg.models, cfg.aliases)
        self.last_used: dict[tuple[str, str], float] = {}
        self._cold: dict[str, asyncio.Task[NodeView]] = {}

    def replace_catalogue(self, models: list[ModelEntry], aliases: dict[str, str]) -> None:
        """The catalogue and aliases to route by (from the database once it is open: at
        start, after an edit here, and every poll interval for edits made elsewhere)."""
        self.catalogue = {m.id: m for m in models}
        self.aliases = dict(aliases)
        self.catalogue_generation += 1

    def routes_by(self, models: list[ModelEntry], aliases: dict[str, str]) -> bool:
        """Whether this catalogue and these aliases are exactly what it routes by now."""
        return self.catalogue == {m.id: m for m in models} and self.aliases == aliases

    # -- naming ----------------------------------------------------------------------
    def concrete(self, model: str) -> str:
        return self.aliases.get(model, model)

    def node_model_id(self, model_id: str) -> str:
        """The id a node loads a catalogue model under (`source:id` when a source is set)."""
        entry = self.catalogue.get(model_id)
        if entry is not None and entry.source:
            return f"{entry.source}:{entry.id}"
        return model_id

    # -- routing ---------------------------------------------------------------------
    async def routes(self, model: str) -> list[Route]:
        """Candidate routes for a request naming `model`, best first (the proxy tries the
        second only when the first fails before answering). Cold-loads when needed."""
        if not self.fleet.up():
            raise service_unavailable(
                "no healthy node is available; retry shortly", NO_NODE_RETRY_AFTER_S
            )
        model_id = self.concrete(model)
        node_id = self.node_model_id(model_id)
        replicas = self.fleet.replicas(node_id)
        if not replicas:
            if any(n.status_of(node_id) == "recovering" for n in self.fleet.up()):
                raise service_unavailable(
                    f"model {model_id!r} is recovering from a device fault; retry shortly",
                    RECOVERING_RETRY_AFTER_S,
                    code="model_recovering",
                )
            loading = [n for n in self.fleet.up() if n.status_of(node_id) == "loading"]
            if model_id not in self.catalogue and not loading:
                raise model_not_found(model)
            replicas = [await self._cold_load(model_id, loading)]
        if len(replicas) > 1:
            replicas.sort(key=lambda n: (self._busy(n, node_id), n.name))
        return [Route(n, node_id, n.inference_url(node_id)) for n in replicas]

    @property
    def in_flight(self) -> dict[tuple[str, str], int]:
        """(node, model) -> requests this gateway is proxying there now (NodeView.proxied)."""
        nodes = self.fleet.nodes.values()
        return {(n.name, m): count for n in nodes for m, count in n.proxied.items()}

    def _busy(self, node: NodeView, node_id: str) -> int:
        """Others' requests on the node at its last poll, and ours now."""
        return node.others_load.get(node_id, 0) + node.proxied.get(node_id, 0)

    def begin(self, route: Route) -> None:
        self.last_used[(route.node.name, route.model_id)] = time.monotonic()
        route.node.proxy_started(route.model_id)

    def end(self, route: Route) -> None:
        self.last_used[(route.node.name, route.model_id)] = time.monotonic()
        route.node.proxy_ended(route.model_id)

    # -- cold loads ------------------------------------------------------------------
    async def _cold_load(self, model_id: str, loading: list[NodeView]) -> NodeView:
        """One load per model however many requests wait for it."""
        task = self._cold.get(model_id)
        if task is None:
            task = asyncio.create_task(self._place(model_id, loading))
            self._cold[model_id] = task
            task.add_done_callback(lambda _t: self._cold.pop(model_id, None))
        return await asyncio.shield(task)

    def feasible(self, entry: ModelEntry, node: NodeView) -> bool:
        """Whether `node` has the devices `entry` asks for. A CPU-only node can take any
        model that asks for no minimum of VRAM: it runs `tensor_parallel` N as N processes."""
        gpus = [d for d in node.devices if d.get("kind", "cuda") == "cuda"]
        if not gpus:
            gpus = [
                {"memory_total_mb": d.get("total_mb")}
                for d in (node.discovery or {}).get("devices", [])
            ]
        if not gpus:
            return entry.min_device_vram_mb is None
        big = [
            d
            for d in gpus
            if entry.min_device_vram_mb is None
            or (d.get("memory_total_mb") or 0) >= entry.min_device_vram_mb
        ]
        return len(big) >= entry.required_devices

    def placement_order(self, model_id: str) -> list[NodeView]:
        """Feasible healthy nodes, pinned ones first, then the most free memory."""
        entry = self.catalogue[model_id]
        nodes = [n for n in self.fleet.up() if self.feasible(entry, n)]

        def free_mb(n: NodeView) -> int:
            return sum(d.get("memory_free_mb") or 0 for d in n.devices)

        return sorted(nodes, key=lambda n: (n.name not in entry.pinned_on, -free_mb(n), n.name))

    def load_body(self, model_id: str) -> dict[str, Any]:
        """The node's `POST /models/load` body for a catalogue model (or a bare id)."""
        body: dict[str, Any] = {"model_id": self.node_model_id(model_id)}
        entry = self.catalogue.get(model_id)
        if entry is not None:
            options = {
                "quant": entry.quant,
                "dtype": entry.dtype,
                "tensor_parallel": entry.tensor_parallel,
                "revision": entry.revision,
                "kv_cache_dtype": entry.kv_cache_dtype,
                "max_model_len": entry.max_model_len,
                "kv_cache_memory_mb": entry.kv_cache_memory_mb,
                # unset: the node's [engine] setting
                "speculative_method": entry.speculative_method,
                "speculative_model": entry.speculative_model,
                "num_speculative_tokens": entry.num_speculative_tokens,
            }
            body |= {k: v for k, v in options.items() if v is not None}
        return body

    async def _place(self, model_id: str, loading: list[NodeView]) -> NodeView:
        node_id = self.node_model_id(model_id)
        # a node already loading it (pre-warm, another gateway) is joined, not raced
        candidates = loading or self.placement_order(model_id)
        if not candidates:
            raise service_unavailable(
                f"no healthy node can hold model {model_id!r}", NO_NODE_RETRY_AFTER_S
            )
        body = self.load_body(model_id)
        errors = []
        for node in candidates:
            status, answer = await self._load_evicting(node, body)
            if status == 200:
                await self.nodes.refresh(node)
                if node.loaded(node_id):
                    return node
                errors.append(f"{node.name}: loaded but not listed")
                continue
            message = (answer.get("error") or {}).get("message") or f"HTTP {status}"
            errors.append(f"{node.name}: {message}")
            event(
                log,
                logging.WARNING,
                "cold load failed",
                model=model_id,
                node=node.name,
                status=status,
                error=message,
            )
        raise service_unavailable(
            f"could not load model {model_id!r}: " + "; ".join(errors),
            LOAD_FAILED_RETRY_AFTER_S,
            code="insufficient_vram"
            if all("memory" in e or "vram" in e for e in errors)
            else "service_unavailable",
        )

    async def _load_evicting(
        self, node: NodeView, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """Load on `node`; while it answers "not enough memory", unload its least recently
        used unpinned model (never one serving a request of ours) and try again."""
        while True:
            status, answer = await self.nodes.load(node, body)
            if status != 503 or (answer.get("error") or {}).get("code") != "insufficient_vram":
                return status, answer
            await self.nodes.refresh(node)  # choose the victim on current load, not a stale poll
            victim = self._eviction_victim(node, body["model_id"])
            if victim is None:
                return status, answer
            log.info("evicting %s from %s to make room for %s", victim, node.name, body["model_id"])
            await self.nodes.unload(node, victim)
            await self.nodes.refresh(node)

    def _eviction_victim(self, node: NodeView, incoming: str) -> str | None:
        pinned = {m.id for m in self.catalogue.values() if node.name in m.pinned_on}
        pinned |= {self.node_model_id(m) for m in pinned}
        candidates = [
            m
            for m, entry in node.models.items()
            if entry.get("status") == "loaded"
            and m != incoming
            and m not in pinned
            and not node.proxied.get(m)
            and not node.load.get(m)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda m: (self.last_used.get((node.name, m), 0.0), m))
