"""Tensor parallel over GGUF files: a rank's part of a quantized tensor, cut from its blocks.

A GGUF tensor is rows of blocks (`GGUFTensor.data`: uint8 [rows, bytes_per_row]); a block
holds `block_size` consecutive weights of one row (32 for Q4_0, Q8_0 and the like, 256 for
the K-quants' super-blocks, 1 for F32/F16/BF16). So a rank's part is cut from the bytes,
nothing dequantized, and stays in the file's quantization:

- along any dimension but the last (a column-parallel layer's output rows, the
  vocab-parallel embedding's and lm_head's rows, rows of stacked experts [E, out, in]):
  whole rows, whatever the qtype. One range of a memory-mapped file is a view of it, so a
  rank reads only its own rows.
- along the last (a row-parallel layer's input columns): whole blocks of every row, so each
  range must start and end on a block boundary. One that does not cannot be cut without
  requantizing: a PlacementError (a 422 at load) naming the tensor, its qtype and the
  tensor_parallel values that would split it. `check_splits` finds these before any weight
  is read.

Ranges past the tensor's end (the vocabulary padded to a multiple of the ranks) read zero
bytes: a zero scale, so zero weights, in every format.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from helexa.engine.loader.dequant import FORMATS
from helexa.engine.parallel import PlacementError, Shard, tp

if TYPE_CHECKING:
    from helexa.engine.loader.gguf_tensor import GGUFTensor


def take_shard(shard: Shard | None, src: torch.Tensor | GGUFTensor) -> torch.Tensor | GGUFTensor:
    """This rank's part of a checkpoint tensor: a torch tensor's by `Shard.take`, a GGUF
    tensor's as its whole blocks (still quantized); all of `src` when `shard` is None."""
    if shard is None:
        return src
    if isinstance(src, torch.Tensor):
        return shard.take(src)
    return take_blocks(src, shard)


def take_blocks(src: GGUFTensor, shard: Shard) -> GGUFTensor:
    """`shard` of a GGUF tensor, cut from its raw bytes: rows whole, columns in whole blocks
    (else PlacementError). The result's `data` is uint8 [rows, bytes_per_row] as the file's."""
    shape = tuple(src.shape)
    assert shape[shard.dim] == shard.total, (src.name, shape, shard)
    check_split(src.name, src.qtype, shape, shard)
    block, block_bytes = FORMATS[src.qtype][:2]
    last = len(shape) - 1

    def unit(i: int) -> int:  # a weight index along `dim` -> an index into the bytes' view
        return i if shard.dim < last else i // block * block_bytes

    # the bytes as [*shape[:-1], bytes_per_row]: rows are indices along every dim but the last
    data = src.data.reshape(*shape[:-1], -1)
    in_bytes = Shard(
        shard.dim, unit(shard.total), tuple((unit(a), unit(b)) for a, b in shard.ranges)
    )
    part = in_bytes.take(data)
    local = list(shape)
    local[shard.dim] = shard.size
    part = part.reshape(math.prod(local[:-1]), -1)
    if part.device.type != "cpu" and part.untyped_storage().nbytes() > part.nbytes:
        part = part.clone()  # a view would keep the whole tensor in device memory
    return dataclasses.replace(src, shape=tuple(local), data=part)


def split_reason(qtype: str, shape: tuple[int, ...], shard: Shard) -> str | None:
    """None when `shard` cuts a `qtype` tensor of `shape` on whole blocks, else why."""
    if shard.dim != len(shape) - 1:
        return None  # rows: whole rows of blocks, whatever the qtype
    block = FORMATS[qtype][0]
    off = [(a, b) for a, b in shard.ranges if a % block or b % block]
    if not off:
        return None
    ranges = ", ".join(f"[{a}, {b})" for a, b in off)
    return (
        f"{qtype} packs each row in blocks of {block} weights, and this rank's input columns "
        f"{ranges} of {shard.total} do not start and end on block boundaries, so its part "
        f"cannot be cut without requantizing"
    )


def check_split(name: str, qtype: str, shape: tuple[int, ...], shard: Shard) -> None:
    """PlacementError unless `shard` cuts the tensor `name` on whole blocks of its qtype."""
    reason = split_reason(qtype, shape, shard)
    if reason is None:
        return
    block = FORMATS[qtype][0]
    blocks = shard.total // block
    ways = [n for n in range(1, min(blocks, 64) + 1) if blocks % n == 0]
    other = " (e.g. Q8_0 or Q4_0)" if block > 32 else ""
    raise PlacementError(
        f"{name} ({qtype} {list(shape)}) cannot be split across "
        f"tensor_parallel={tp().world_size}: {reason}",
        f"tensor_parallel in {ways} splits its {shard.total} columns into whole blocks; or "
        f"load a file that quantizes this tensor in 32-weight blocks{other}, or the "
        "safetensors checkpoint",
    )


def check_splits(model: nn.Module, tensors: Mapping[str, GGUFTensor]) -> None:
    """Refuse a file whose tensors this rank's shards of `model` cannot cut on whole
    blocks (PlacementError), before any weight is read.

    Tensors are matched to their layers as the model's `load_weights` names them (the
    checkpoint prefix cut, `<layer>.weight`, stacked experts `<experts>.<projection>`);
    a tensor matched to nothing here is checked when its layer loads it.
    """
    modules = dict(model.named_modules())
    prefixes = getattr(model, "weight_prefixes", ())
    for name, t in tensors.items():
        path = next((name[len(p) :] for p in prefixes if name.startswith(p)), name)
        owner, _, kind = path.rpartition(".")
        mod = modules.get(owner)
        shape = tuple(t.shape)
        if (
            hasattr(mod, "load_stacked")
            and len(mod)
            and kind in ("gate_proj", "up_proj", "down_proj")
        ):
            mod, shape = getattr(mod[0], kind, None), shape[1:]  # each expert's [out, in]
        elif kind != "weight":
            continue
        shard = getattr(mod, "shard", None)
        if isinstance(shard, Shard) and len(shape) > shard.dim and shape[shard.dim] == shard.total:
            check_split(t.name, t.qtype, shape, shard)
