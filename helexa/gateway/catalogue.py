"""`GET /v1/models` on the gateway: the catalogue on the nodes that can hold it, everything
loaded anywhere, and each alias as its own entry."""

from __future__ import annotations

from typing import Any

from helexa.gateway.fleet import NodeView
from helexa.gateway.router import Router

_LIMIT_KEYS = ("context", "input", "output")


def model_list(router: Router, created: int) -> list[dict[str, Any]]:
    fleet = router.fleet
    entries: dict[str, dict[str, Any]] = {}
    for model_id, entry in router.catalogue.items():
        node_id = router.node_model_id(model_id)
        feasible = [
            n.name for n in sorted(fleet.up(), key=lambda n: n.name) if router.feasible(entry, n)
        ]
        card = _card(model_id, node_id, fleet.nodes.values(), created)
        card["feasible_on"] = feasible
        price = entry.cost.price()  # USD per 1M tokens, the cache's unset ones at input's
        card["cost"] = {
            "input": price.input,
            "output": price.output,
            "cache_read": price.cache_read,
            "cache_write": price.cache_write,
        }
        card["pinned_on"] = list(entry.pinned_on)
        entries[model_id] = card
    for node in fleet.up():
        for node_id in node.models:
            if node_id not in entries and not any(
                router.node_model_id(m) == node_id for m in router.catalogue
            ):
                entries[node_id] = _card(node_id, node_id, fleet.nodes.values(), created)
    for alias, target in sorted(router.aliases.items()):
        if target in entries:
            entries[alias] = {**entries[target], "id": alias, "alias_of": target}
    return list(entries.values())


def _card(model_id: str, node_id: str, nodes, created: int) -> dict[str, Any]:
    locations = []
    details: list[dict[str, Any]] = []
    for node in sorted(nodes, key=lambda n: n.name):
        status = node.status_of(node_id)
        if status is not None:
            locations.append({"node": node.name, "status": status})
            if status == "loaded":
                details.append(node.models[node_id])
    statuses = {loc["status"] for loc in locations}
    status = next((s for s in ("loaded", "recovering", "loading") if s in statuses), "available")
    first = details[0] if details else {}
    limit = _tightest([d.get("limit") for d in details])
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "helexa",
        "loaded": status == "loaded",
        "status": status,
        "feasible_on": [],
        "locations": locations,
        "limit": limit,
        "max_model_len": (limit or {}).get("context"),
        "cost": {"input": 0.0, "output": 0.0},
        "capabilities": first.get("capabilities", ["text"]),
        "tool_call": bool(first.get("tool_call", False)),
        "reasoning": bool(first.get("reasoning", False)),
    }


def _tightest(limits: list[Any]) -> dict[str, int] | None:
    """The smallest of each limit across the nodes serving a model: it holds wherever the
    request goes."""
    limits = [lim for lim in limits if isinstance(lim, dict)]
    if not limits:
        return None
    return {
        k: min(lim[k] for lim in limits if isinstance(lim.get(k), int))
        for k in _LIMIT_KEYS
        if any(isinstance(lim.get(k), int) for lim in limits)
    }


def nodes_view(nodes: list[NodeView]) -> list[dict[str, Any]]:
    return [n.describe() for n in sorted(nodes, key=lambda n: n.name)]
