"""The engine settings a benchmark prints beside its figures (bench engine, gpu, --sides)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from helexa.engine import LLMEngine


def engine_settings(engine: LLMEngine) -> dict[str, Any]:
    from helexa.engine.layers.linear import Linear

    a = engine.args
    # How the Linear weights are held (packed int4, float, ...) decides much of the speed.
    modules = engine.loaded.model.modules()
    formats = Counter(_weight_format(m) for m in modules if isinstance(m, Linear))
    return {
        "model": str(engine.loaded.path),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "linear_weights": " ".join(f"{k}×{n}" for k, n in sorted(formats.items())),
        "kv_cache_mb": a.kv_cache_memory_mb,
        "kv_cache_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
        "num_kv_blocks": engine.runner.num_blocks,
        "block_size": a.block_size,
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_prefill_chunk": a.max_prefill_chunk or a.max_num_batched_tokens,
        "enable_prefix_caching": a.enable_prefix_caching,
    }


def _weight_format(m: torch.nn.Module) -> str:
    fmt = getattr(m, "format", "float")
    dense = getattr(m, "dense", None)  # a float copy used for wide batches, if kept
    return fmt if dense is None else f"{fmt}+{str(dense.dtype).removeprefix('torch.')}"
