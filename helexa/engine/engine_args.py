"""How to build an engine: `EngineArgs` (`[engine]` of helexa.toml plus what only a caller
knows), and the memory a device has left for it. Apart from `llm_engine.py` so that the
tensor-parallel followers (rank_worker.py) read them without importing the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from helexa.config import EngineConfig

if TYPE_CHECKING:
    from helexa.engine.loader.load import LoadedModel

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(slots=True)
class EngineArgs(EngineConfig):
    """How to build an engine: `[engine]` of helexa.toml (defaults and meanings live
    there) plus what only a caller knows."""

    model: str | None = None  # local dir, .gguf file or hub id; None → the bundled SmolLM2
    num_kv_blocks: int | None = None  # fixes the pool size in blocks (tests, tuning)
    cache_dir: str | None = None  # hub download cache; None → HF_HUB_CACHE / HF_HOME
    gguf_quant: str | None = None  # which file of a `-GGUF` hub repo, e.g. "Q4_K_M"
    revision: str | None = None  # hub branch, tag or commit; None → main
    tensor_parallel: int = 1  # ranks (one process each) the model is split across
    devices: list[int] | None = None  # CUDA device of each rank; None → 0..tensor_parallel-1
    autotune_dir: str | None = None  # where CPU kernel plans are kept; None → measured anew
    # a directory whose tokenizer.json and chat template a GGUF file is served with instead
    # of the ones rebuilt from its metadata (vLLM's `tokenizer`): its base repository's
    tokenizer: str | None = None

    @classmethod
    def from_config(cls, engine: EngineConfig, model: str | None = None, **kw) -> EngineArgs:
        """`[engine]` of helexa.toml as engine arguments; keyword arguments override it."""
        values = {f.name: getattr(engine, f.name) for f in fields(engine)}
        return cls(**{**values, "model": model, **kw})

    def load(self, ref: str, device: torch.device) -> LoadedModel:
        """The model `ref` names, loaded on `device` as these arguments say (under tensor
        parallel, this rank's shard)."""
        from helexa.engine.loader.load import load_model

        return load_model(
            ref,
            device=device,
            dtype=self.torch_dtype(device),
            quant=self.quant,
            cache_dir=self.cache_dir,
            dense_copies=self.cpu_dense_copy,
            gguf_quant=self.gguf_quant,
            revision=self.revision,
            tokenizer=self.tokenizer,
        )

    def torch_device(self) -> torch.device:
        if self.device in ("auto", "", None):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype | None:
        if self.dtype is None or self.dtype == "auto":
            return None
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        try:
            return _DTYPES[self.dtype.lower()]
        except KeyError:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; supported: {sorted(_DTYPES)}"
            ) from None


def kv_dtype(setting: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for `[engine] kv_cache_dtype` = `setting` on `device`
    under a model computing in `model_dtype`, with the kernel backend already set. Raises
    ValueError for a type the step's kernels do not read: the Triton kernels (CUDA, or
    `kernels = "triton"`) read the cache in the model's dtype."""
    from helexa import kernels

    triton = kernels.triton_on(device)
    if setting == "auto":
        cpu_half = not triton and device.type == "cpu" and model_dtype == torch.float32
        return torch.float16 if cpu_half else model_dtype
    chosen = _DTYPES[setting]
    if triton and chosen != model_dtype:
        raise ValueError(
            f"kv_cache_dtype = {setting!r} under the Triton kernels ({device.type}): their "
            f"KV cache is the model's dtype ({str(model_dtype).removeprefix('torch.')}); "
            'use "auto"'
        )
    return chosen


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
