"""Tensor parallelism: which rank this process is, and the collectives sharded layers use.

One process per rank (`helexa.engine.rank_worker` spawns them). World size 1, the default,
is the unsharded model: every helper below is then the identity and costs nothing. The
device collectives run on `group` (NCCL on CUDA, gloo on CPU) with the deadline the engine
gives (`[engine] step_timeout_s`), so a hung all-reduce raises instead of waiting forever.
Which part of a weight a rank holds is worked out here too (`shard_range`, `head_shard`,
`vocab_range`, `Shard`), at build time: a forward at world size 1 never asks.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PlacementError(ValueError):
    """A model cannot be split the way the load asks (heads that do not divide, GGUF blocks
    that a rank's columns would cut, more ranks than devices): a 422 at load, before any
    weight moves."""

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


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Within: this process is rank 0 of 1, so a model built here is whole (speculative
    decoding's draft model, which rank 0 alone runs). Such a model holds no sharded layer,
    so its forward takes part in no collective, whatever the group outside."""
    global _TP
    saved, _TP = _TP, TensorParallel()
    try:
        yield
    finally:
        _TP = saved


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


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """This rank's [start, end) of the vocabulary padded up to a multiple of the world size
    (rows past `vocab_size` are zeros): the vocab-parallel embedding's and lm_head's."""
    t = _TP
    per = -(-vocab_size // t.world_size)
    return t.rank * per, (t.rank + 1) * per


@dataclass(frozen=True, slots=True)
class HeadShard:
    """This rank's attention heads: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int


def head_shard(num_heads: int, num_kv_heads: int) -> HeadShard:
    """Split the query heads evenly; the KV heads too when there are at least as many as
    ranks, else each rank keeps the one KV head its query heads read (replicated across
    world_size / num_kv_heads ranks)."""
    n, r = _TP.world_size, _TP.rank
    q0, q1 = shard_range(num_heads, "num_attention_heads")
    if num_kv_heads >= n:
        kv0, kv1 = shard_range(num_kv_heads, "num_key_value_heads")
        return HeadShard(q0, q1, kv0, kv1)
    if n % num_kv_heads:
        raise PlacementError(
            f"num_key_value_heads ({num_kv_heads}) is below tensor_parallel={n} and does not "
            f"divide it, so the ranks cannot share KV heads evenly",
            f"pick a tensor_parallel that is a multiple of {num_kv_heads} or divides it",
        )
    kv = r * num_kv_heads // n
    return HeadShard(q0, q1, kv, kv + 1)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which parts of a checkpoint tensor this rank holds: `ranges` [start, end) along `dim`
    of a tensor `total` long there, concatenated; a range past `total` reads zeros (padding)."""

    dim: int
    total: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def full_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The checkpoint's shape of a tensor held as `local`."""
        shape = list(local)
        shape[self.dim] = self.total
        return tuple(shape)

    def take(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor `w`."""
        assert w.shape[self.dim] == self.total, (tuple(w.shape), self.dim, self.total)
        parts = []
        for a, b in self.ranges:
            lo, hi = min(a, self.total), min(b, self.total)
            part = w.narrow(self.dim, lo, hi - lo)
            if b > self.total:  # padding rows past the end
                pad = list(w.shape)
                pad[self.dim] = b - max(a, self.total)
                part = torch.cat([part, w.new_zeros(pad)], dim=self.dim)
            parts.append(part)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


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
