"""The node's loaded models: load, unload, look up, recover from device faults.

Each model owns an `AsyncLLM` (its own engine thread) and an `Admission`, so loading,
unloading or overloading one model never touches requests to another.
"""

from __future__ import annotations

import asyncio
import difflib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.config import DTYPES, IN_SITU_QUANTS, Config
from helexa.engine import AsyncLLM, EngineArgs, LLMEngine
from helexa.engine.loader.load import BUNDLED_MODEL_ID, ModelNotFoundError
from helexa.engine.models import UnsupportedModelError
from helexa.errors import HelexaError, model_not_found, service_unavailable
from helexa.node.activation import Activation
from helexa.node.admission import Admission, AdmissionLimits
from helexa.protocol.reasoning import ReasoningMarkers
from helexa.protocol.tool_calls import ToolCallMarkers
from helexa.protocol.wire import DEFAULT_MAX_OUTPUT_TOKENS

log = logging.getLogger(__name__)

MiB = 1 << 20
GGUF_QUANTS = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_K", "Q5_0", "Q5_1",
    "Q4_K_M", "Q4_K_S", "Q4_K", "Q4_0", "Q4_1", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K",
)  # fmt: skip
RECOVERY_RETRY_AFTER_S = 10.0


class LoadError(HelexaError):
    """A load refused before or while loading: 422 `{error: {kind, model_id, message,
    suggestion}}` (SPEC `POST /models/load`), or 503 when memory is short."""

    def __init__(
        self,
        kind: str,
        model_id: str,
        message: str,
        suggestion: str | None = None,
        *,
        status: int = 422,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(
            status,
            "invalid_request_error" if status == 422 else "service_unavailable",
            message,
            code=kind,
            retry_after=retry_after,
            extra={"kind": kind, "model_id": model_id, "suggestion": suggestion},
        )


@dataclass(slots=True, frozen=True)
class LoadOptions:
    """`POST /models/load` body: what to load and how."""

    model_id: str
    quant: str | None = None
    dtype: str | None = None
    devices: tuple[int, ...] | None = None
    tensor_parallel: int = 1
    revision: str | None = None
    # what to load when it differs from model_id: a path's real location, or a hub id
    # with its source scheme (see node/security.loadable_ref)
    ref: str | None = None


@dataclass(slots=True)
class ServedModel:
    """One loaded model and its traffic."""

    id: str
    options: LoadOptions
    llm: AsyncLLM
    admission: Admission
    status: str = "loaded"  # loaded | recovering | poisoned
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    memory_mb: int = field(init=False)  # fixed once loaded: weights and KV pool
    # marker pairs found in the vocabulary (never guessed from the model's name)
    reasoning_markers: ReasoningMarkers | None = field(init=False)
    tool_call_markers: ToolCallMarkers | None = field(init=False)
    markers_are_special: bool = field(init=False)
    # the template teaches Qwen XML calls (`<function=name>`) rather than Hermes JSON
    teaches_xml_calls: bool = field(init=False)

    def __post_init__(self) -> None:
        self.memory_mb = model_memory_mb(self.llm.engine.runner.model)
        tok = self.llm.engine.tokenizer
        self.reasoning_markers = ReasoningMarkers.from_vocab(tok)
        self.tool_call_markers = ToolCallMarkers.from_vocab(tok)
        markers = [m for m in (self.reasoning_markers, self.tool_call_markers) if m is not None]
        # Special marker tokens ([THINK] in Mistral vocabularies) would vanish in decoding,
        # and the reasoning with them would pass for content: chat answers keep them.
        self.markers_are_special = any(tok.is_special(t) for m in markers for t in (m.start, m.end))
        template = tok.chat_template
        sources = template.values() if isinstance(template, dict) else [template or ""]
        self.teaches_xml_calls = any("<function=" in t for t in sources)

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limit(self) -> dict[str, int]:
        """context = the engine's ceiling (positions, KV pool, config); output = what a
        request may generate by default; input = the rest, rounded down to 1024 when
        large enough to round."""
        context = self.max_model_len
        output = min(DEFAULT_MAX_OUTPUT_TOKENS, max(1, context // 4))
        room = context - output
        return {
            "context": context,
            "input": room - room % 1024 if room >= 2048 else room,
            "output": output,
        }

    @property
    def capabilities(self) -> list[str]:
        return ["text"]

    def describe(self) -> dict[str, Any]:
        """One `/models` entry."""
        engine = self.engine
        device = engine.runner.device
        return {
            "id": self.id,
            "status": self.status,
            "devices": [device.index or 0] if device.type == "cuda" else [],
            "device": str(device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quant": self.options.quant or _gguf_quant_of(engine),
            "format": engine.loaded.source_format,
            "capabilities": self.capabilities,
            "tool_call": self.tool_call_markers is not None,
            "reasoning": self.reasoning_markers is not None,
            "limit": self.limit,
            "memory_mb": self.memory_mb,
            "in_flight": self.admission.num_running,
            "queue_depth": self.admission.queue_depth,
            "loaded_at": int(self.loaded_at),
            "load_seconds": round(self.load_seconds, 2),
        }


def model_memory_mb(model: torch.nn.Module) -> int:
    """Weights (packed, dense copies), KV pool and buffers: every tensor the model's
    modules hold, as parameters or as plain attributes, each storage counted once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        attrs = (v for v in vars(module).values() if isinstance(v, torch.Tensor))
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False), *attrs):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) // MiB


def _gguf_quant_of(engine: LLMEngine) -> str | None:
    if engine.loaded.source_format != "gguf":
        return None
    stem = engine.loaded.path.stem.upper().replace("-", ".")
    return next((q for q in GGUF_QUANTS if q in stem.split(".")), "gguf")


class ModelRegistry:
    """Loaded models by id, plus the loads in flight."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.models: dict[str, ServedModel] = {}
        self.activation = Activation()
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
        args = self._engine_args(options)  # preflight: refuses before any allocation
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
            raise LoadError("model_not_found", model_id, str(e), _not_found_hint(model_id)) from e
        except UnsupportedModelError as e:
            raise LoadError("unsupported_architecture", model_id, str(e)) from e
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

    def _engine_args(self, options: LoadOptions) -> EngineArgs:
        """EngineArgs for a load, or the 422 naming the first impossible option."""
        model_id = options.model_id
        kw: dict[str, Any] = {"revision": options.revision}
        if options.quant:
            q = options.quant
            if q.lower() in IN_SITU_QUANTS:
                kw["quant"] = q.lower()
            else:
                canonical = {g.replace("_", ""): g for g in GGUF_QUANTS}.get(
                    q.upper().replace("_", "").replace("-", "")
                )
                if canonical is None:
                    raise LoadError(
                        "invalid_quant",
                        model_id,
                        f"unknown quant {q!r}; in-situ: {list(IN_SITU_QUANTS)}, "
                        f"GGUF files: {list(GGUF_QUANTS)}",
                        _nearest(q, [*IN_SITU_QUANTS, *GGUF_QUANTS]),
                    )
                kw["gguf_quant"] = canonical
        if options.dtype:
            if options.dtype not in DTYPES:
                raise LoadError(
                    "invalid_dtype",
                    model_id,
                    f"unknown dtype {options.dtype!r}; supported: {list(DTYPES)}",
                    _nearest(options.dtype, list(DTYPES)),
                )
            kw["dtype"] = options.dtype
        if options.tensor_parallel != 1:
            raise LoadError(
                "tensor_parallel_unsupported",
                model_id,
                f"tensor_parallel={options.tensor_parallel}: this node serves each model on "
                "one device",
                "load with tensor_parallel = 1",
            )
        if options.devices:
            count = torch.cuda.device_count()
            bad = [d for d in options.devices if not 0 <= d < count]
            if bad:
                raise LoadError(
                    "device_unavailable",
                    model_id,
                    f"devices {bad} do not exist on this node ({count} CUDA devices)",
                    "see GET /discovery for the devices",
                )
            kw["device"] = f"cuda:{options.devices[0]}"
        ref = options.ref or model_id
        scheme, sep, _rest = ref.partition(":")
        source = self.cfg.sources.get(
            scheme if sep and "/" in _rest else self.cfg.node.default_source
        )
        if source is not None and source.cache_dir is not None:
            kw["cache_dir"] = str(source.cache_dir)
        return EngineArgs.from_config(self.cfg.engine, ref, **kw)

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

    async def load_defaults(self) -> None:
        """Load `default_models` (the bundled SmolLM2 when none) one after another."""
        ids = list(dict.fromkeys(self.cfg.node.default_models)) or [BUNDLED_MODEL_ID]
        self.activation.start(ids)
        for model_id in ids:
            self.activation.begin(model_id)
            try:
                await self.load(LoadOptions(model_id))
            except HelexaError as e:
                log.error("default model %s failed to load: %s", model_id, e.message)
                self.activation.fail(model_id, e.message)
            except Exception as e:  # never leave activation stuck in pre_warming
                log.exception("default model %s failed to load", model_id)
                self.activation.fail(model_id, f"{type(e).__name__}: {e}")
            else:
                self.activation.succeed(model_id)
        failed = len(self.activation.failed)
        log.info("ready: %d of %d default models loaded", len(ids) - failed, len(ids))

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


def _nearest(value: str, choices: list[str]) -> str | None:
    lowered = {c.lower(): c for c in choices}
    hit = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.5)
    return f"did you mean {lowered[hit[0]]!r}?" if hit else None


def _not_found_hint(model_id: str) -> str:
    if model_id.lower().endswith("-gguf"):
        return "name the GGUF file's quant, e.g. quant = 'Q4_K_M'"
    return "check the id, or pre-fetch it into the hub cache when the node is offline"
