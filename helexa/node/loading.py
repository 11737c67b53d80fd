"""What a `POST /models/load` asks for, checked before anything is allocated: the body's
shape (`LoadOptions`), then quant, dtype, devices and source (`engine_args`), each refusal
the 400 or 422 naming the first impossible field."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

import torch

from helexa.config import DTYPES, IN_SITU_QUANTS, Config
from helexa.engine import EngineArgs
from helexa.errors import HelexaError, invalid_request

GGUF_QUANTS = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_K", "Q5_0", "Q5_1",
    "Q4_K_M", "Q4_K_S", "Q4_K", "Q4_0", "Q4_1", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K",
)  # fmt: skip


class LoadError(HelexaError):
    """A load refused before or while loading: 422 `{error: {kind, model_id, message,
    suggestion}}` (docs/node.md § Routes), or 503 when memory is short."""

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


def parse_load_options(body: Any) -> LoadOptions:
    """The `POST /models/load` body as LoadOptions, or the 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid_request("expected a JSON object with model_id", "body")

    def opt(name: str, kind: type, what: str) -> Any:
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise invalid_request(f"{name}: expected {what}, got {json.dumps(value)}", name)
        return value

    model_id = opt("model_id", str, "a string")
    if not model_id:
        raise invalid_request("model_id: required", "model_id")
    devices = opt("devices", list, "an array of device indices")
    if devices is not None and not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices
    ):
        raise invalid_request("devices: expected non-negative integers", "devices")
    tp = opt("tensor_parallel", int, "an integer")
    if tp is not None and tp < 1:
        raise invalid_request("tensor_parallel: must be >= 1", "tensor_parallel")
    return LoadOptions(
        model_id=model_id,
        quant=opt("quant", str, "a string"),
        dtype=opt("dtype", str, "a string"),
        devices=tuple(devices) if devices else None,
        tensor_parallel=tp or 1,
        revision=opt("revision", str, "a string"),
    )


def engine_args(cfg: Config, options: LoadOptions) -> EngineArgs:
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
            f"tensor_parallel={options.tensor_parallel}: this node serves each model on one device",
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
    scheme, sep, rest = ref.partition(":")
    source = cfg.sources.get(scheme if sep and "/" in rest else cfg.node.default_source)
    if source is not None and source.cache_dir is not None:
        kw["cache_dir"] = str(source.cache_dir)
    return EngineArgs.from_config(cfg.engine, ref, **kw)


def not_found_hint(model_id: str) -> str:
    """What to try when `model_id` names nothing loadable."""
    if model_id.lower().endswith("-gguf"):
        return "name the GGUF file's quant, e.g. quant = 'Q4_K_M'"
    return "check the id, or pre-fetch it into the hub cache when the node is offline"


def _nearest(value: str, choices: list[str]) -> str | None:
    lowered = {c.lower(): c for c in choices}
    hit = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.5)
    return f"did you mean {lowered[hit[0]]!r}?" if hit else None
