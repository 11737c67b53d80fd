"""The node as one object, built once at start: its config, loaded models, metrics, the
default models' activation, the gateway's named requests and whether it is draining; plus
what its management routes answer (health, discovery, a model's entry or endpoint, loads
and unloads), without HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from helexa.config import Config
from helexa.engine.loader.load import BUNDLED_MODEL_ID
from helexa.errors import HelexaError, invalid_request, model_not_found, service_unavailable
from helexa.node.activation import Activation
from helexa.node.discovery import device_stats, discovery
from helexa.node.exchanges import Exchanges
from helexa.node.loading import parse_load_options
from helexa.node.metrics import NodeMetrics
from helexa.node.registry import ModelRegistry
from helexa.node.security import loadable_ref, unauthenticated_warning

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Node:
    """Everything a node's handlers need; `build_node` makes the one a process serves."""

    cfg: Config
    registry: ModelRegistry
    metrics: NodeMetrics
    activation: Activation = field(default_factory=Activation)
    exchanges: Exchanges = field(default_factory=Exchanges)  # final usage of named requests
    started_at: float = field(default_factory=time.time)
    draining: bool = False  # set on SIGTERM: new work is refused, in-flight work finishes
    # set once load_defaults has ended, however it ended: the node is ready (`ready`)
    defaults_loaded: asyncio.Event = field(default_factory=asyncio.Event)
    # told a line as each default model starts loading (the CLI hands it to systemd)
    on_progress: Callable[[str], None] | None = None

    def refuse_if_draining(self, why: str = "the node is shutting down") -> None:
        """503 once draining: the caller should try another node."""
        if self.draining:
            raise service_unavailable(why, 5)

    # -- lifecycle -----------------------------------------------------------------
    async def load_defaults(self) -> None:
        """Load `default_models` (the bundled SmolLM2 when none) one after another."""
        bodies = self.cfg.node.default_loads() or [{"model_id": BUNDLED_MODEL_ID}]
        ids = [body["model_id"] for body in bodies]
        activation = self.activation
        activation.start(ids)
        try:
            for i, body in enumerate(bodies, 1):
                model_id = body["model_id"]
                activation.begin(model_id)
                if self.on_progress is not None:
                    self.on_progress(f"loading {model_id} ({i} of {len(ids)})")
                await self._load_default(body)
            log.info("ready: %s", activation.summary())
        finally:
            self.defaults_loaded.set()

    async def _load_default(self, body: dict[str, Any]) -> None:
        """One default model, its table's options checked as a `POST /models/load` body's
        (a bad one fails that model alone, with the reason)."""
        activation, model_id = self.activation, body["model_id"]
        try:
            await self.registry.load(parse_load_options(body))
        except HelexaError as e:
            log.error("default model %s failed to load: %s", model_id, e.message)
            activation.fail(model_id, e.message)
        except Exception as e:  # never leave activation stuck in pre_warming
            log.exception("default model %s failed to load", model_id)
            activation.fail(model_id, f"{type(e).__name__}: {e}")
        else:
            activation.succeed(model_id)

    async def ready(self) -> str:
        """Wait for the default models' load to end; a line saying how it went. A node
        whose default model failed is ready too: it serves other models."""
        await self.defaults_loaded.wait()
        return self.activation.summary()

    async def shutdown(self) -> None:
        """Refuse new work and unload every model."""
        self.draining = True
        await self.registry.shutdown()
        log.info("node stopped: all models unloaded")

    # -- what the management routes answer -----------------------------------------
    async def health(self) -> dict[str, Any]:
        """The `/health` body: status, uptime, devices, activation, per-model traffic."""
        return {
            "status": "draining" if self.draining else "ok",
            "uptime_s": round(time.time() - self.started_at, 1),
            "devices": await asyncio.to_thread(device_stats),
            "activation": {
                **self.activation.to_dict(),
                "downloads": self.registry.downloads.to_list(),
            },
            "models": [
                {
                    "id": m.id,
                    "status": m.status,
                    "in_flight": m.admission.num_running,
                    "queue_depth": m.admission.queue_depth,
                    "workers": m.llm.describe_workers(),
                }
                for m in self.registry.models.values()
            ],
            "recoveries": self.registry.num_recoveries,
        }

    async def discovery(self) -> dict[str, Any]:
        """The `/discovery` body: the host, its devices, and how the node is protected."""
        inputs = [m.limit["input"] for m in self.registry.models.values()]
        found = await asyncio.to_thread(discovery, min(inputs) if inputs else None)
        found["auth"] = "api_key" if self.cfg.node.api_key else "none"
        warning = unauthenticated_warning(self.cfg.node.host, self.cfg.node)
        found["warnings"] = [warning] if warning else []
        return found

    def model_info(self, path: str, base_url: str) -> dict[str, Any]:
        """`{id}/endpoint`: where to send inference for a model (`advertise_endpoint`, else
        `base_url`); `{id}`: its `/models` entry. 404 when no loaded model has that id."""
        model_id = path.strip("/")
        wants_endpoint = model_id.endswith("/endpoint")
        if wants_endpoint:
            model_id = model_id.removesuffix("/endpoint")
        # the router folds `//`, so `/models//srv/m/endpoint` names `/srv/m` as well as `srv/m`
        models = self.registry.models
        served = models.get(model_id) or models.get("/" + model_id)
        if served is None:
            raise model_not_found(model_id)
        if not wants_endpoint:
            return served.describe()
        base = self.cfg.node.advertise_endpoint or base_url
        return {"model_id": served.id, "endpoint": base.rstrip("/")}

    async def load(self, body: Any, notes: MutableMapping[str, Any]) -> dict[str, Any]:
        """Load what a `POST /models/load` body asks for, once it is known to be allowed."""
        self.refuse_if_draining()
        options = parse_load_options(body)
        notes["model"] = options.model_id
        roots, bundled = self.cfg.node.model_dirs or [], BUNDLED_MODEL_ID
        source = self.cfg.node.default_source
        ref = loadable_ref(options.model_id, roots, bundled, source=source)
        # a draft model is loaded too: the same rule for what may be loaded holds for it
        draft = options.speculative_model
        draft_ref = draft and loadable_ref(draft, roots, bundled, "speculative_model", source)
        served = await self.registry.load(
            dataclasses.replace(options, ref=ref, draft_ref=draft_ref)
        )
        return {"status": "loaded", "model": served.describe()}

    async def unload(self, body: Any) -> dict[str, Any]:
        """Unload the model a `POST /models/unload` body names; 404 when none serves it."""
        model_id = body.get("model_id") if isinstance(body, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise invalid_request("model_id: expected a non-empty string", "model_id")
        if not await self.registry.unload(model_id):
            raise model_not_found(model_id)
        return {"status": "unloaded", "model_id": model_id}


def build_node(cfg: Config) -> Node:
    """The node a process serves from `cfg`; models load later (`Node.load_defaults`)."""
    registry = ModelRegistry(cfg)
    return Node(cfg, registry, NodeMetrics(registry))
