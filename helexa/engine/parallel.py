"""Tensor parallelism: which rank this process is, and the collectives sharded layers use.

One process per rank (`helexa.engine.rank_worker` spawns them). World size 1, the default,
is the unsharded model: every helper below is then the identity and costs nothing. The
device collectives run on `group` (NCCL on CUDA, gloo on CPU) with the deadline the engine
gives (`[engine] step_timeout_s`), so a hung all-reduce raises instead of waiting forever.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PlacementError(ValueError):
    """A model cannot be split the way the load asks (heads that do not divide, GGUF with
    tensor parallel, more ranks than devices): a 422 at load, before any weight moves."""

    def __init__(self, message: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.suggestion = suggestion


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # device collectives

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


_TP = TensorParallel()


def tp() -> TensorParallel:
    """This process's place in the tensor-parallel group (rank 0 of 1 when not sharded)."""
    return _TP


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
) -> TensorParallel:
    """Join the group: NCCL when `device` is CUDA, gloo otherwise. Collectives past
    `timeout_s` raise (gloo) or abort the process (NCCL), never hang."""
    global _TP
    if world_size == 1:
        _TP = TensorParallel()
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kw,
    )
    _TP = TensorParallel(rank, world_size, dist.group.WORLD)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.enabled and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallel()


def shard_range(total: int, what: str) -> tuple[int, int]:
    """This rank's [start, end) of `total` items split evenly; PlacementError when they
    do not divide."""
    t = _TP
    if total % t.world_size:
        raise PlacementError(
            f"{what} ({total}) do not divide across tensor_parallel={t.world_size}",
            "pick a tensor_parallel that divides it",
        )
    size = total // t.world_size
    return t.rank * size, (t.rank + 1) * size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (row-parallel outputs)."""
    if _TP.enabled:
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension (vocab-parallel logits)."""
    t = _TP
    if not t.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(t.world_size)]
    dist.all_gather(parts, x.contiguous(), group=t.group)
    return torch.cat(parts, dim=-1)
