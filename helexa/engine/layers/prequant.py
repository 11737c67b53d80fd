"""How a Linear holds a pre-quantized checkpoint's weight (loader/prequant.py reads the files).

On the CPU, in the layouts torch's packed kernels run (Linear's formats "int4" and "int8"):

- AWQ, GPTQ (w = (q - z) * s per group) -> "int4". `_weight_int4pack_mm_for_cpu` computes
  (q - 8) * scale + zero per group of 32 inputs, so a file's group of G (a multiple of 32) is
  G/32 such groups sharing scale = s and zero = (8 - z) * s, the codes as they are. Both are
  held in bf16, as the kernel takes them: zero is rounded from the unrounded s, so a code of 8
  is exact to bf16 and the others off by (q - 8) times s's rounding (2^-9 of s at most).
- fp8 -> "int8": dequantized (e4m3 times its block scale, exact in float32), then requantized
  with one symmetric scale per output channel, as quant = "int8" does a float weight (the
  CPU has no fp8 kernel): ~0.5% rms of a trained weight. Said in the load's log.

A weight those kernels cannot take (in_features no multiple of 32, int4 out_features no
multiple of 16, AWQ/GPTQ groups that split a run of 32) is held dequantized, as float, logged.

On an accelerator, as a kernels.QuantWeight, exact to the file: AWQ and GPTQ as "int4_zp"; fp8
as "fp8_block", or as "fp8" (one scale per output channel) where one block spans the whole
input (a per-tensor scale among them). A weight those cannot hold raises UnsupportedQuantError.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from helexa import kernels
from helexa.engine.layers.linear import (
    DENSE_DTYPE,
    Linear,
    UnsupportedQuantError,
    _quantize_int8,
    kernel_layout,
)
from helexa.kernels.quant_pack import QuantWeight, pack_fp8_blocks, pack_zero_point

log = logging.getLogger(__name__)


class PrequantSource(Protocol):
    """What holding a pre-quantized weight reads of it (loader/prequant.PrequantTensor)."""

    name: str
    shape: tuple[int, int]  # (out_features, in_features)

    @property
    def qtype(self) -> str: ...  # "fp8" | "awq" | "gptq"

    @property
    def device(self) -> torch.device: ...

    def describe(self) -> str: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def groups_of_32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...

    def fp8_blocks(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]: ...


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info(message)


def hold(linear: Linear, src: PrequantSource, *, dtype: torch.dtype, dense_copy: bool) -> None:
    """Give `linear` the weight of `src`, kept quantized on its device (module doc); `dtype` is
    the activation dtype, `dense_copy` keeps a float32 copy beside a CPU-packed weight."""
    if linear.shard is not None:
        raise UnsupportedQuantError(
            f"{src.name}: a {src.describe()} weight cannot be split across ranks yet",
            "serve a pre-quantized checkpoint with tensor_parallel = 1",
        )
    shape = (linear.out_features, linear.in_features)
    if tuple(src.shape) != shape:
        raise ValueError(f"{src.name}: weight shape {list(src.shape)} != {list(shape)}")
    linear.dtype = dtype
    if kernel_layout(src.device):
        qw = quant_weight(src)
        if (reason := kernels.unsupported_reason(qw.kind, src.device)) is not None:
            raise UnsupportedQuantError(f"{src.name} as {qw.kind}: {reason}")
        linear.format, linear.k_repeat, linear.qweight = "quant", 1, qw
        linear.weight = linear.scales = linear.dense = None
        return
    if src.qtype == "fp8" and linear._can_pack("int8"):
        _say_once(f"{src.describe()}: requantized to int8 per output channel on the CPU")
        linear._set_int8(*_quantize_int8(src.dequantize()))
    elif src.qtype != "fp8" and linear._can_pack("int4") and (groups := src.groups_of_32()):
        codes, s, z = groups
        s = s.float()
        linear._set_int4(codes, s, (8 - z.float()) * s)
    else:
        log.info("%s: %s held dequantized, as float (no packed layout takes [%d, %d])",
                 src.name, src.describe(), *shape)  # fmt: skip
        linear._set_float(src.dequantize(), dtype)
    if dense_copy and linear.format != "float":
        linear.dense = src.dequantize(DENSE_DTYPE).contiguous()


def quant_weight(src: PrequantSource) -> QuantWeight:
    """`src` as the accelerator's kernels hold it (exact): int4_zp, fp8_block or fp8."""
    out, inp = src.shape
    where = f"{src.name} [{out}, {inp}] ({src.describe()})"
    if inp % 32:
        raise UnsupportedQuantError(f"{where}: the kernels take in_features in groups of 32")
    if src.qtype == "fp8":
        w, scale, (bn, bk) = src.fp8_blocks()
        if scale.shape[1] == 1:  # one block across the input: a scale per output channel
            rows = scale[:, 0].repeat_interleave(bn)[:out].contiguous()
            return QuantWeight("fp8", out, inp, qs=w.contiguous().view(torch.uint8), scales=rows)
        if bk % 32:
            raise UnsupportedQuantError(f"{where}: blocks split the kernels' groups of 32 inputs")
        return pack_fp8_blocks(w, scale, (bn, bk))
    groups = src.groups_of_32()
    if groups is None:
        raise UnsupportedQuantError(f"{where}: groups split the kernels' groups of 32 inputs")
    return pack_zero_point(*groups)
