"""What the gateway knows of its nodes: who answers, what each has loaded, how busy it is.

The poller writes it; the router and `/v1/models` read it. Plain data, no I/O.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

NOT_ANSWERING = "not answering"
KEY_REFUSED = "refused the gateway's api_key"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]", "::"}


@dataclass(slots=True)
class NodeView:
    """One `[[nodes]]` entry and the last answers it gave."""

    name: str
    endpoint: str  # as configured, no trailing slash
    api_key: str | None = field(default=None, repr=False)  # the node's [node] api_key
    up: bool = False
    last_seen: float | None = None
    last_error: str | None = None  # the wire detail: for the log and the admin console
    down_reason: str | None = None  # what the public GET /health says instead
    discovery: dict[str, Any] | None = None
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # /models by id
    load: dict[str, int] = field(default_factory=dict)  # id -> in_flight + queue_depth
    # Of that load, what is not ours: the node's count includes the requests this gateway
    # proxies to it, which the router counts itself, live. Subtracted: the most of ours in
    # flight at any time since the poll was sent (the node counted them at some instant in
    # between). Without it a request of ours that a poll caught stayed on the node's books
    # until the next poll, and the next request saw that node as busy as a really busy one.
    others_load: dict[str, int] = field(default_factory=dict)
    proxied: dict[str, int] = field(default_factory=dict)  # id -> ours in flight now (router)
    _proxied_peak: dict[str, int] = field(default_factory=dict, repr=False)
    activation: dict[str, Any] | None = None
    devices: list[dict[str, Any]] = field(default_factory=list)  # /health devices
    endpoints: dict[str, str] = field(default_factory=dict)  # model id -> inference base URL

    @property
    def max_prompt_tokens(self) -> int | None:
        value = (self.discovery or {}).get("max_prompt_tokens")
        return value if isinstance(value, int) and value > 0 else None

    def poll_started(self) -> None:
        """A poll of /health goes out now: ours in flight from here on count against it."""
        self._proxied_peak = {k: v for k, v in self.proxied.items() if v}

    def proxy_started(self, model_id: str) -> None:
        n = self.proxied[model_id] = self.proxied.get(model_id, 0) + 1
        self._proxied_peak[model_id] = max(self._proxied_peak.get(model_id, 0), n)

    def proxy_ended(self, model_id: str) -> None:
        self.proxied[model_id] = max(0, self.proxied.get(model_id, 0) - 1)

    def loaded(self, model_id: str) -> bool:
        return self.up and self.models.get(model_id, {}).get("status") == "loaded"

    def status_of(self, model_id: str) -> str | None:
        return self.models.get(model_id, {}).get("status") if self.up else None

    def inference_url(self, model_id: str) -> str:
        """Where to send inference for `model_id`: what the node advertised, with a loopback
        host replaced by the host the gateway reaches the node at."""
        advertised = self.endpoints.get(model_id)
        if not advertised:
            return self.endpoint
        return with_reachable_host(advertised, self.endpoint)

    def auth_headers(self) -> dict[str, str]:
        """What every call to this node carries: its own key, never a client's."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def mark_up(
        self,
        models: list[dict[str, Any]],
        health: dict[str, Any],
    ) -> None:
        self.up = True
        self.last_seen = time.time()
        self.last_error = self.down_reason = None
        self.models = {m["id"]: m for m in models if isinstance(m, dict) and "id" in m}
        self.load = {
            m["id"]: int(m.get("in_flight", 0)) + int(m.get("queue_depth", 0))
            for m in health.get("models", [])
            if isinstance(m, dict) and "id" in m
        }
        peak = self._proxied_peak
        self.others_load = {k: max(0, v - peak.get(k, 0)) for k, v in self.load.items()}
        self.activation = health.get("activation")
        self.devices = list(health.get("devices") or [])
        for gone in set(self.endpoints) - set(self.models):
            del self.endpoints[gone]

    def mark_down(self, error: str, reason: str = NOT_ANSWERING) -> None:
        self.up = False
        self.last_error, self.down_reason = error, reason

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "endpoint": self.endpoint,
            "up": self.up,
            "last_seen": self.last_seen,
            "last_error": self.down_reason,  # never addresses or exception text
            "models": sorted(self.models),
            "load": dict(self.load),
            "devices": self.devices,
        }


@functools.lru_cache(maxsize=1024)
def with_reachable_host(advertised: str, configured: str) -> str:
    """`advertised` with its host taken from `configured` when it names a loopback address:
    a node behind NAT or bound to 0.0.0.0 does not know how the gateway reaches it. (Asked
    on every request, of a handful of distinct pairs: kept.)"""
    adv = urlsplit(advertised.rstrip("/"))
    if adv.hostname not in LOOPBACK_HOSTS:
        return advertised.rstrip("/")
    conf = urlsplit(configured)
    if conf.hostname in LOOPBACK_HOSTS:
        return advertised.rstrip("/")
    port = f":{adv.port}" if adv.port else ""
    host = conf.hostname if ":" not in (conf.hostname or "") else f"[{conf.hostname}]"
    return urlunsplit((adv.scheme, f"{host}{port}", adv.path, "", ""))


class Fleet:
    """All configured nodes, by name."""

    def __init__(
        self, nodes: list[tuple[str, str]], api_keys: Mapping[str, str | None] | None = None
    ) -> None:
        keys = api_keys or {}
        self.nodes = {
            name: NodeView(name, endpoint.rstrip("/"), keys.get(name)) for name, endpoint in nodes
        }

    def up(self) -> list[NodeView]:
        return [n for n in self.nodes.values() if n.up]

    def replicas(self, model_id: str) -> list[NodeView]:
        """Nodes serving `model_id` now, sorted by name."""
        found = [n for n in self.nodes.values() if n.loaded(model_id)]
        if len(found) > 1:  # (asked on every request: one replica is the common case)
            found.sort(key=operator.attrgetter("name"))
        return found
