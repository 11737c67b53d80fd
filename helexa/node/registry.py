"""The node's loaded models: load, unload, look up, recover from device faults.

Each model owns an `AsyncLLM` (its own engine thread) and an `Admission`, so loading,
unloading or overloading one model never touches requests to another.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

import torch

from helexa.config import Config
from helexa.engine import AsyncLLM, EngineArgs, LLMEngine
from helexa.engine.layers.linear import UnsupportedQuantError
from helexa.engine.loader.load import ModelNotFoundError
from helexa.engine.models import UnsupportedModelError
from helexa.errors import model_not_found, service_unavailable
from helexa.node.admission import Admission, AdmissionLimits
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
        self._poison_pending = {cfg.node.debug_poison} if cfg.node.debug_poison else set()
        self._limits = AdmissionLimits(
            max_running=cfg.node.max_running_requests,
            max_waiting=cfg.node.max_waiting_requests,
            max_wait_s=cfg.node.max_queue_wait_s,
            per_principal_max=cfg.node.per_principal_max,
        )

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
        """True once for the model named by HELEXA_DEBUG_POISON: inject one fault."""
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
            llm = await AsyncLLM.build(lambda: LLMEngine(args))
        except (ModelNotFoundError, FileNotFoundError) as e:
            raise LoadError("model_not_found", model_id, str(e), not_found_hint(model_id)) from e
        except UnsupportedModelError as e:
            raise LoadError("unsupported_architecture", model_id, str(e)) from e
        except UnsupportedQuantError as e:
            raise LoadError("unsupported_quant", model_id, str(e), e.suggestion) from e
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise LoadError(
                "insufficient_vram",
                model_id,
                f"not enough memory to load {model_id!r}: {e}",
                "unload another model or pick a smaller quant",
                status=503,
                retry_after=30,
            ) from e
        except Exception as e:
            log.exception("loading %s failed", model_id)
            raise LoadError("load_failed", model_id, f"{type(e).__name__}: {e}") from e
        finally:
            self._loading.pop(model_id, None)
        served = ServedModel(model_id, options, llm, Admission(self._limits))
        served.load_seconds = time.monotonic() - t0
        cap = self.cfg.node.max_model_memory_mb
        held = sum(m.memory_mb for m in self.models.values())
        if cap is not None and held + served.memory_mb > cap:
            await asyncio.to_thread(llm.shutdown)
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
        await asyncio.to_thread(served.llm.shutdown)
        del served
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("unloaded model %s", model_id)
        return True

    # -- faults ----------------------------------------------------------------------
    def report_fault(self, model_id: str, error: BaseException) -> None:
        """A device fault (NaN/Inf logits): mark the model and reload it in the background."""
        served = self.models.get(model_id)
        if served is None or model_id in self._recovering:
            return
        log.error("model %s poisoned (%s); reloading it", model_id, error)
        served.status = "recovering"
        self._recovering[model_id] = asyncio.create_task(self._recover(served))

    async def _recover(self, served: ServedModel) -> None:
        try:
            await self.unload(served.id)
            await self.load(served.options)
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
