"""Dequantize GGUF tensors from their raw bytes with vectorized torch (no loop over blocks).

Each format is a run of fixed-size blocks along the last dimension; every block holds
`block_size` weights in `type_size` bytes. Layouts follow ggml-quants.c; the arithmetic is done
in float32 in the same order as `gguf.quants`, so results match it bit for bit. Work happens in
place on the one float buffer per tensor: fresh allocations are what dominates on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

QK_K = 256  # weights per super-block of the k-quants


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte `offset` of every block: [n, T] uint8 -> [n, 1] f32."""
    # every block size is even and blocks are contiguous, so view the bytes as halves in place
    return blocks.view(torch.float16)[:, offset // 2 : offset // 2 + 1].float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split each run of `group` bytes into its low nibbles then its high nibbles.

    qs: [n, m] uint8 -> [n, 2m] uint8, ordered (run, low/high, byte) as ggml stores them.
    """
    n, m = qs.shape
    runs = qs.reshape(n, m // group, 1, group)
    out = torch.empty(n, m // group, 2, group, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(runs, 0x0F, out=out[:, :, :1])
    torch.bitwise_right_shift(runs, 4, out=out[:, :, 1:])
    return out.reshape(n, 2 * m)


def _shifts(*bits: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8, device=like.device)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, m] uint8 -> [n, 8m] of 0/1, bit i of the little-endian bit string at column i."""
    return ((qh.unsqueeze(-1) >> _shifts(*range(8), like=qh)) & 1).reshape(qh.shape[0], -1)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32)


def _f16_weights(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.bfloat16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # block: d f16 | 32 x int8
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # block: d f16 | 16 bytes of nibbles; w = d * (q - 8)
    return _nibbles(b[:, 2:], 16).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # block: d f16 | m f16 | 16 bytes of nibbles; w = d * q + m
    return _nibbles(b[:, 4:], 16).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # block: d f16 | 32 high bits | 16 bytes of nibbles; w = d * (q - 16)
    q = _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6]) << 4)
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # block: d f16 | m f16 | 32 high bits | 16 bytes of nibbles; w = d * q + m
    q = _nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8]) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed into 12 bytes (Q4_K, Q5_K): two [n, 8] uint8."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # super-block: d f16 | dmin f16 | 12 bytes scales/mins | 128 bytes of nibbles (8 x 32 weights)
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return _k_apply(b, q, scales, mins)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # super-block: d | dmin | 12 bytes scales/mins | 32 bytes high bits | 128 bytes of nibbles
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    # bit j of byte i is the high bit of weight i in sub-block j
    high = (b[:, 16:48].unsqueeze(1) >> _shifts(*range(8), like=b).view(1, 8, 1)) & 1
    return _k_apply(b, (low | (high << 4)).float(), scales, mins)


def _k_apply(
    b: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """w = d * scale * q - dmin * min for q: [n, 8, 32] f32 (Q4_K, Q5_K)."""
    ds = (_f16(b, 0) * scales.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return q.mul_(ds).sub_(dm).reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # super-block: 128 bytes low nibbles | 64 bytes 2-bit highs | 16 x int8 scales | d f16
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    shifts = _shifts(0, 2, 4, 6, like=b).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).float().sub_(32)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return q.mul_(d).reshape(n, QK_K)


# qtype -> (weights per block, bytes per block, [n_blocks, bytes] uint8 -> [n_blocks, weights] f32)
FORMATS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, _f32),
    "F16": (1, 2, _f16_weights),
    "BF16": (1, 2, _bf16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def check_format(qtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(block_size, type_size) of `qtype`, after checking that rows of `shape` split into blocks."""
    if qtype not in FORMATS:
        raise ValueError(f"unsupported GGUF tensor type {qtype!r}; supported: {list(FORMATS)}")
    block_size, type_size, _ = FORMATS[qtype]
    if shape and shape[-1] % block_size:
        raise ValueError(f"{qtype} row length {shape[-1]} is not a multiple of {block_size}")
    return block_size, type_size


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes (uint8, any shape) of type `qtype` -> float32 tensor of `shape`.

    Runs on `data`'s device. F32 comes back as a view of `data`, not a copy.
    """
    block_size, type_size = check_format(qtype, shape)
    num_blocks = math.prod(shape) // block_size
    assert data.dtype == torch.uint8, f"expected raw uint8 bytes, got {data.dtype}"
    if data.numel() != num_blocks * type_size:
        raise ValueError(
            f"{qtype} tensor of shape {shape} needs {num_blocks * type_size} bytes, "
            f"got {data.numel()}"
        )
    blocks = data.reshape(num_blocks, type_size).contiguous()
    return FORMATS[qtype][2](blocks).reshape(shape)
