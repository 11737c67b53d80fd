"""What a `POST /models/load` asks for, checked before anything is allocated: the body's
shape (`LoadOptions`), then quant, dtype, devices and source (`engine_args`), each refusal
the 400 or 422 naming the first impossible field."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from helexa.config import DTYPES, IN_SITU_QUANTS, KV_CACHE_DTYPES, Config
from helexa.engine import EngineArgs
from helexa.engine.parallel import PlacementError
from helexa.engine.rank_worker import placement
from helexa.errors import HelexaError, invalid_request
from helexa.protocol.wire import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

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
        param: str | None = None,
    ) -> None:
        super().__init__(
            status,
            "invalid_request_error" if status == 422 else "service_unavailable",
            message,
            code=kind,
            param=param,
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
    # speculative decoding for this model, each None for the [engine] setting: the method
    # (wire.SPECULATIVE_METHODS), the draft model ("draft_model" only), the draft's length
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    # the KV cache for this model, each None for the [engine] setting: its dtype ("auto",
    # "float32", "float16"), the longest context, the pool's size in MiB
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    kv_cache_memory_mb: int | None = None
    # what to load when it differs from model_id: a path's real location, or a hub id
    # with its source scheme (see node/security.loadable_ref); `draft_ref` is the same
    # for speculative_model
    ref: str | None = None
    draft_ref: str | None = None


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
    for name in ("max_model_len", "kv_cache_memory_mb"):
        value = opt(name, int, "an integer")
        if value is not None and value < 1:
            raise invalid_request(f"{name}: must be >= 1", name)
    return LoadOptions(
        model_id=model_id,
        quant=opt("quant", str, "a string"),
        dtype=opt("dtype", str, "a string"),
        devices=tuple(devices) if devices else None,
        tensor_parallel=tp or 1,
        revision=opt("revision", str, "a string"),
        speculative_method=opt("speculative_method", str, "a string"),
        speculative_model=opt("speculative_model", str, "a string"),
        num_speculative_tokens=opt("num_speculative_tokens", int, "an integer"),
        kv_cache_dtype=opt("kv_cache_dtype", str, "a string"),
        max_model_len=opt("max_model_len", int, "an integer"),
        kv_cache_memory_mb=opt("kv_cache_memory_mb", int, "an integer"),
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
    kw |= _speculative(options)
    kw |= _kv(options)
    kw |= _placement(cfg, options)
    ref = options.ref or model_id
    _check_heads(model_id, ref, options.tensor_parallel)
    kw["autotune_dir"] = str(cfg.node.state_dir / "autotune")
    args = EngineArgs.from_config(cfg.engine, ref, **kw)
    try:
        placement(args)  # the engine's own refusals (more ranks than devices...)
    except PlacementError as e:
        raise LoadError("invalid_placement", model_id, str(e), e.suggestion) from e
    return args


def _kv(options: LoadOptions) -> dict[str, Any]:
    """EngineArgs for this model's KV cache, over [engine]'s (each option left out keeps the
    node's), or the 422 `invalid_kv` naming the field."""
    kw: dict[str, Any] = {}
    dtype = options.kv_cache_dtype
    if dtype is not None:
        if dtype not in KV_CACHE_DTYPES:
            raise LoadError(
                "invalid_kv",
                options.model_id,
                f"unknown kv_cache_dtype {dtype!r}; supported: {list(KV_CACHE_DTYPES)}",
                _nearest(dtype, list(KV_CACHE_DTYPES)),
                param="kv_cache_dtype",
            )
        kw["kv_cache_dtype"] = dtype
    for name in ("max_model_len", "kv_cache_memory_mb"):
        if (value := getattr(options, name)) is not None:
            kw[name] = value
    return kw


def _speculative(options: LoadOptions) -> dict[str, Any]:
    """EngineArgs for this model's speculative decoding, over [engine]'s (each option left
    out keeps the node's), or the 422 `invalid_speculative` naming the field (`param`)."""
    model_id, method = options.model_id, options.speculative_method
    draft, num = options.speculative_model, options.num_speculative_tokens

    def refuse(param: str, message: str, suggestion: str | None) -> LoadError:
        return LoadError("invalid_speculative", model_id, message, suggestion, param=param)

    if method is not None and method not in SPECULATIVE_METHODS:
        raise refuse(
            "speculative_method",
            f"unknown speculative_method {method!r}; supported: {list(SPECULATIVE_METHODS)}",
            _nearest(method, list(SPECULATIVE_METHODS)),
        )
    if num is not None and not 1 <= num <= MAX_SPECULATIVE_TOKENS:
        raise refuse(
            "num_speculative_tokens",
            f"num_speculative_tokens {num} is outside 1..{MAX_SPECULATIVE_TOKENS}",
            "draft 2 to 5 tokens; a longer draft is rarely accepted whole",
        )
    if method != "draft_model" and draft is not None:
        raise refuse(
            "speculative_model",
            f"speculative_model is only for speculative_method 'draft_model', not {method!r}",
            "set speculative_method to 'draft_model', or leave speculative_model out",
        )
    if method == "draft_model" and not draft:
        raise refuse(
            "speculative_model",
            "speculative_method 'draft_model' needs speculative_model: the draft model's id",
            "name a small model that shares this model's tokenizer",
        )
    # a draft model is loaded by the engine beside its target; an engine without the
    # argument cannot, and must say so rather than speculate some other way
    takes_draft = "speculative_model" in {f.name for f in fields(EngineArgs)}
    if method == "draft_model" and not takes_draft:
        raise refuse(
            "speculative_method",
            "this node's engine has no draft-model speculative decoding yet",
            "use 'ngram', or 'off'",
        )
    kw: dict[str, Any] = {}
    if method is not None:
        kw["speculative_method"] = None if method == "off" else method
    if method == "draft_model":
        kw["speculative_model"] = options.draft_ref or draft
    elif method is not None and takes_draft:
        kw["speculative_model"] = None  # [engine]'s draft model is not this load's
    if num is not None:
        kw["num_speculative_tokens"] = num
    return kw


def _placement(cfg: Config, options: LoadOptions) -> dict[str, Any]:
    """Devices for the load's ranks, or the 422 when they do not exist. A CUDA node puts
    rank r on `devices[r]` (0..N-1 when not named); a CPU node runs N ranks as N processes."""
    model_id, tp = options.model_id, options.tensor_parallel
    on_cpu = cfg.engine.device == "cpu" or (
        cfg.engine.device == "auto" and not torch.cuda.is_available()
    )
    kw: dict[str, Any] = {"tensor_parallel": tp}
    if options.devices:
        if on_cpu:
            raise LoadError(
                "device_unavailable",
                model_id,
                f"devices {list(options.devices)}: this node runs models on the CPU",
                "leave devices out",
            )
        count = torch.cuda.device_count()
        bad = [d for d in options.devices if not 0 <= d < count]
        if bad:
            raise LoadError(
                "device_unavailable",
                model_id,
                f"devices {bad} do not exist on this node ({count} CUDA devices)",
                "see GET /discovery for the devices",
            )
        if len(set(options.devices)) != len(options.devices) or len(options.devices) < tp:
            raise LoadError(
                "invalid_placement",
                model_id,
                f"tensor_parallel={tp} needs {tp} distinct devices, got {list(options.devices)}",
                f"name {tp} devices, or leave devices out",
            )
        kw["devices"] = list(options.devices[:tp])
        kw["device"] = f"cuda:{options.devices[0]}"
    elif tp > 1 and not on_cpu:
        count = torch.cuda.device_count()
        if tp > count:
            raise LoadError(
                "invalid_placement",
                model_id,
                f"tensor_parallel={tp} needs {tp} GPUs; this node has {count}",
                f"load with tensor_parallel <= {count}",
            )
    return kw


def _check_heads(model_id: str, ref: str, tp: int) -> None:
    """The 422 when a local checkpoint's heads cannot be split `tp` ways (a hub model's
    config is read before its download: node/repo_check.py)."""
    if tp == 1:
        return
    try:
        with open(f"{ref}/config.json") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return
    check_heads(model_id, hf, tp)


def check_heads(model_id: str, hf: dict[str, Any], tp: int) -> None:
    """The 422 `invalid_placement` when config.json's heads cannot be split `tp` ways."""
    if tp == 1:
        return
    hf = hf.get("text_config", hf)
    problems = []
    heads = hf.get("num_attention_heads")
    if heads and heads % tp:
        problems.append(f"{heads} attention heads do not divide across {tp} ranks")
    kv = hf.get("num_key_value_heads")
    if kv and (kv % tp if kv >= tp else tp % kv):
        problems.append(f"{kv} KV heads can be neither split nor replicated across {tp} ranks")
    for key, what in (
        ("linear_num_key_heads", "linear-attention key heads"),
        ("linear_num_value_heads", "linear-attention value heads"),
    ):
        n = hf.get(key)
        if n and n % tp:
            problems.append(f"{n} {what} do not divide across {tp} ranks")
    if problems:
        raise LoadError(
            "invalid_placement",
            model_id,
            f"tensor_parallel={tp}: " + "; ".join(problems),
            "pick a tensor_parallel that divides the model's heads",
        )


def not_found_hint(model_id: str) -> str:
    """What to try when `model_id` names nothing loadable."""
    if model_id.lower().endswith("-gguf"):
        return "name the GGUF file's quant, e.g. quant = 'Q4_K_M'"
    return "check the id, or pre-fetch it into the hub cache when the node is offline"


def _nearest(value: str, choices: list[str]) -> str | None:
    lowered = {c.lower(): c for c in choices}
    hit = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.5)
    return f"did you mean {lowered[hit[0]]!r}?" if hit else None
