"""The node's loaded models: load, unload, look up, recover from faults.

Each model owns a `WorkerClient` (its engine in worker processes, one per tensor-parallel
rank) and an `Admission`, so loading, unloading, overloading or crashing one model never
touches requests to another, and never the node process itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from helexa.config import Config
from helexa.engine import EngineArgs
from helexa.engine.worker_client import WorkerClient, WorkerLoadError
from helexa.errors import model_not_found, service_unavailable
from helexa.node.admission import Admission, AdmissionLimits
from helexa.node.fetching import Downloads, fetch_refs
from helexa.node.loading import LoadError, LoadOptions, engine_args, not_found_hint
from helexa.node.served import ServedModel

log = logging.getLogger(__name__)

RECOVERY_RETRY_AFTER_S = 10.0


class ModelRegistry:
    """Loaded models by id, plus the loads in flight."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.models: dict[str, ServedModel] = {}
        self._loading: dict[str, tuple[LoadOptions, asyncio.Task[ServedModel]]] = {}
        self._recovering: dict[str, asyncio.Task[None]] = {}
        self.downloads = Downloads()  # hub fetches in flight (node/fetching.py)
        self.num_recoveries = 0
        self._poison_pending = {cfg.node.debug_poison} if cfg.node.debug_poison else set()
        self._limits = AdmissionLimits(
            max_running=cfg.node.max_running_requests,
            max_waiting=cfg.node.max_waiting_requests,
            max_wait_s=cfg.node.max_queue_wait_s,
            per_principal_max=cfg.node.per_principal_max,
        )

    def _admission_limits(self, llm: WorkerClient) -> AdmissionLimits:
        """The node's limits, running no more at once than the engine can: past that,
        requests wait in admission, whose queue is fair across callers, rather than in the
        engine's, which is first come first served."""
        engine_max = llm.facts.max_num_seqs or self._limits.max_running
        return replace(self._limits, max_running=min(self._limits.max_running, engine_max))

    # -- lookup ----------------------------------------------------------------------
    def get(self, model_id: str) -> ServedModel:
        """The model serving `model_id`: 404 when unknown, 503 + Retry-After while it
        loads or recovers."""
        served = self.models.get(model_id)
        if served is not None and served.status == "loaded":
            return served
        if served is not None or model_id in self._recovering:
            raise service_unavailable(
                f"model {model_id!r} is recovering from a device fault; retry shortly",
                RECOVERY_RETRY_AFTER_S,
                code="model_recovering",
            )
        if model_id in self._loading:
            raise service_unavailable(
                f"model {model_id!r} is loading; retry shortly",
                RECOVERY_RETRY_AFTER_S,
                code="model_loading",
            )
        raise model_not_found(model_id)

    def describe(self) -> list[dict[str, Any]]:
        """`/models`: loaded, recovering and loading models."""
        out = [m.describe() for m in self.models.values()]
        for model_id, (options, _task) in self._loading.items():
            if model_id not in self.models:
                status = "recovering" if model_id in self._recovering else "loading"
                out.append(
                    {"id": model_id, "status": status, "quant": options.quant, "devices": []}
                )
        return out

    def take_debug_poison(self, model_id: str) -> bool:
        """True once for the model named by HELEXA_DEBUG_POISON: its first worker injects
        one device fault at its first step."""
        if model_id in self._poison_pending:
            self._poison_pending.discard(model_id)
            return True
        return False

    # -- load / unload ---------------------------------------------------------------
    async def load(self, options: LoadOptions) -> ServedModel:
        """Load a model (or join the load already running); returns once it serves."""
        served = self.models.get(options.model_id)
        if served is not None:
            return served
        if options.model_id in self._loading:
            return await asyncio.shield(self._loading[options.model_id][1])
        args = engine_args(self.cfg, options)  # preflight: refuses before any allocation
        task = asyncio.create_task(self._load(options, args))
        self._loading[options.model_id] = (options, task)
        return await asyncio.shield(task)

    async def _load(self, options: LoadOptions, args: EngineArgs) -> ServedModel:
        model_id = options.model_id
        t0 = time.monotonic()
        log.info("loading model %s", model_id)
        try:
            args, tokenizer = await fetch_refs(self.cfg, model_id, args, self.downloads)
            llm = await WorkerClient.start(
                model_id,
                args,
                log_cfg=self.cfg.log,
                debug_poison=self.take_debug_poison(model_id),
                on_fault=lambda why: self.report_fault(model_id, why),
            )
        except WorkerLoadError as e:
            raise _load_error(model_id, e) from e
        except LoadError:
            raise
        except Exception as e:
            log.exception("loading %s failed", model_id)
            raise LoadError("load_failed", model_id, f"{type(e).__name__}: {e}") from e
        finally:
            self._loading.pop(model_id, None)
        served = ServedModel(
            model_id,
            options,
            llm,
            Admission(self._admission_limits(llm)),
            image_limits=self.cfg.node.images,
        )
        if tokenizer is not None and served.llm.facts.tokenizer == args.tokenizer:
            served.tokenizer_label = tokenizer  # the base repository's id, not its cache path
        served.load_seconds = time.monotonic() - t0
        cap = self.cfg.node.max_model_memory_mb
        held = sum(m.memory_mb for m in self.models.values())
        if cap is not None and held + served.memory_mb > cap:
            await llm.shutdown()
            raise LoadError(
                "insufficient_vram",
                model_id,
                f"{model_id!r} needs {served.memory_mb} MiB; loaded models hold {held} of the "
                f"node's max_model_memory_mb = {cap}",
                "unload a model first",
                status=503,
                retry_after=10,
            )
        self.models[model_id] = served
        log.info(
            "loaded model %s in %.1fs (context %d tokens)",
            model_id,
            served.load_seconds,
            served.max_model_len,
        )
        return served

    async def unload(self, model_id: str) -> bool:
        """Stop serving `model_id`, abort its requests, free its memory; False if absent."""
        served = self.models.pop(model_id, None)
        if served is None:
            return False
        await served.llm.shutdown()  # the worker's exit frees its memory, all of it
        log.info("unloaded model %s", model_id)
        return True

    # -- faults ----------------------------------------------------------------------
    def report_fault(self, model_id: str, why: str) -> None:
        """A worker faulted (device fault, died, stopped answering): its requests have
        failed and its processes are killed; mark the model poisoned and reload it."""
        served = self.models.get(model_id)
        if served is None or model_id in self._recovering or served.llm.state == "stopped":
            return
        log.error("model %s poisoned (%s); reloading it in a fresh worker", model_id, why)
        served.status = "poisoned"
        self._recovering[model_id] = asyncio.create_task(self._recover(served))

    async def _recover(self, served: ServedModel) -> None:
        try:
            await served.llm.shutdown()  # faulted: killed already, only reaped
            served.status = "recovering"
            if self.models.get(served.id) is served:
                del self.models[served.id]
            await self.load(served.options)
            self.num_recoveries += 1
            log.info("model %s recovered", served.id)
        except Exception:
            log.exception("model %s could not be reloaded; it stays unloaded", served.id)
        finally:
            self._recovering.pop(served.id, None)

    async def shutdown(self) -> None:
        for task in list(self._recovering.values()):
            task.cancel()
        for model_id in list(self.models):
            await self.unload(model_id)


def _load_error(model_id: str, e: WorkerLoadError) -> LoadError:
    """What the worker said about a failed load, as the node's 422 (503 when short of memory)."""
    if e.kind == "model_not_found":
        return LoadError(e.kind, model_id, e.message, not_found_hint(model_id))
    if e.kind == "insufficient_vram":
        return LoadError(
            e.kind,
            model_id,
            f"not enough memory to load {model_id!r}: {e.message}",
            "unload another model or pick a smaller quant",
            status=503,
            retry_after=30,
        )
    return LoadError(e.kind, model_id, e.message, e.suggestion)
