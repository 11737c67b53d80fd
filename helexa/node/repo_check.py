"""What a node refuses of a hub repository before downloading it (issue 39's preflight): from
its file list and its config.json (one small file) or a GGUF's header (one ranged request of
its first bytes), an architecture the engine does not run,
a pre-quantized format it does not read, heads that `tensor_parallel` cannot split, and
weights that cannot fit the memory of the devices they would load on, each a 422 with what
to do instead. A GGUF quant that is not there is refused by the file choice itself
(sources/fetch.select).

The memory check is a lower bound, so that it never refuses what could load: the weights'
bytes on disk split over the ranks, shrunk by an in-situ quant (int8 half, int4 a quarter of
a 16-bit checkpoint), against each device's total memory (free memory is the load's own
check, a 503 that unloading another model cures)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helexa.engine import EngineArgs
from helexa.engine.layers.linear import UnsupportedQuantError
from helexa.engine.loader.gguf import SUPPORTED_ARCHS
from helexa.engine.loader.prequant import scheme_of
from helexa.engine.models import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_model_type
from helexa.node.loading import LoadError, check_heads
from helexa.sources.fetch import RepoFile, RepoReader, gguf_architecture

MIB = 1024 * 1024
WEIGHTS = (".safetensors", ".gguf")
# an in-situ quant's bytes per weight against a 16-bit checkpoint's (a lower bound)
_SHRINK = {"int8": 0.5, "int4": 0.25, "fp8": 0.5}


def repo_checker(
    model_id: str, args: EngineArgs, device_total_mb: Callable[[], list[int]]
) -> Callable[[list[RepoFile], RepoReader], None]:
    """The check `sources.fetch.fetch` runs before downloading a load's files;
    `device_total_mb`: the total memory of each device the load could use (read only if the
    weights are worth comparing)."""

    def check(files: list[RepoFile], repo: RepoReader) -> None:
        ggufs = [f.name for f in files if f.name.lower().endswith(".gguf")]
        if ggufs:  # its architecture from the first part's header (one ranged request)
            head = repo.head(ggufs[0])
            arch = gguf_architecture(head) if head is not None else None
            if arch is not None and arch not in SUPPORTED_ARCHS:
                raise LoadError(
                    "unsupported_architecture",
                    model_id,
                    f"{model_id!r}: unsupported GGUF architecture {arch!r}",
                    f"pick a GGUF of a supported architecture ({', '.join(SUPPORTED_ARCHS)})",
                )
        else:
            config = repo.json("config.json")
            if config is None:
                raise LoadError(
                    "model_not_found",
                    model_id,
                    f"{model_id!r} has no config.json: not a transformers checkpoint",
                    "for a GGUF repository name its quant (quant = 'Q4_K_M')",
                )
            _check_config(model_id, config, args.tensor_parallel)
        _check_memory(model_id, files, args, device_total_mb)

    return check


def _check_config(model_id: str, config: dict[str, Any], tp: int) -> None:
    try:
        check_model_type(config.get("model_type"))
    except UnsupportedModelError as e:
        raise LoadError(
            "unsupported_architecture",
            model_id,
            f"{model_id!r}: {e}",
            f"pick a model of a supported family ({', '.join(sorted(SUPPORTED_MODEL_TYPES))}), "
            "or a GGUF of one",
        ) from None
    try:
        scheme_of(config)
    except UnsupportedQuantError as e:
        raise LoadError("unsupported_quant", model_id, f"{model_id!r}: {e}", e.suggestion) from None
    check_heads(model_id, config, tp)


def _check_memory(
    model_id: str,
    files: list[RepoFile],
    args: EngineArgs,
    device_total_mb: Callable[[], list[int]],
) -> None:
    weights = sum(f.size or 0 for f in files if f.name.lower().endswith(WEIGHTS))
    if not weights:
        return
    gguf = any(f.name.lower().endswith(".gguf") for f in files)
    shrink = 1.0 if gguf else _SHRINK.get(args.quant or "", 1.0)
    per_rank_mb = weights * shrink / max(1, args.tensor_parallel) / MIB
    totals = device_total_mb()
    if not totals:
        return
    smallest = min(totals)
    if per_rank_mb > smallest:
        where = "each GPU" if args.tensor_parallel > 1 else "the device"
        raise LoadError(
            "model_too_large",
            model_id,
            f"{model_id!r} needs at least {per_rank_mb:,.0f} MiB of weights on {where} "
            f"(tensor_parallel={args.tensor_parallel}); it has {smallest:,} MiB in all",
            "a smaller quant (a GGUF Q4_K_M, or quant = 'int4'), or tensor_parallel over more GPUs",
        )
