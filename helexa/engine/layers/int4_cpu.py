"""Reading torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`) back: single rows
(how the token embeddings share a tied lm_head's packed table instead of holding a float copy
of it) and the whole weight (what a wide prompt chunk's float32 GEMM takes), exactly to the
held (scale, zero) pairs, for any row count the packing takes.

The packing cuts the N rows into blocks of BLOCK_N ([K, BLOCK_N / 2] bytes each, k-major); the
last block holds what is left over (N % BLOCK_N rows: 16, 32 or 48). A full block pairs row j
with row j + BLOCK_N / 2 in byte j (low nibble, high nibble) where torch's kernels are vectorized
(BLOCK_N 64 with AVX-512, 32 with AVX2); every other block (the short last one, or all of them
under torch's scalar kernels) pairs rows 2j and 2j + 1. So a 32-row shard on AVX-512 is packed
in pairs where the whole 64-row weight is packed in halves: the layout depends on the row count,
the values and their arithmetic do not. BLOCK_N and the pairing are found by packing a probe
once per process rather than assumed from the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP = 32  # int4 group along K: one scale and zero per 32 weights
_CANDIDATE_BLOCK_N = (64, 32, 16)
# Rows of the probe: a short last block for every candidate (2 x 64 + 48, 5 x 32 + 16, ...).
_PROBE_ROWS = 176


@dataclass(frozen=True, slots=True)
class Layout:
    """How this process's torch packs int4 rows: blocks of `block_n` rows; `halves`: a full
    block pairs row j with row j + block_n / 2 (else rows 2j and 2j + 1, as short blocks do)."""

    block_n: int
    halves: bool


@functools.cache
def layout() -> Layout | None:
    """The packing's layout on this CPU, or None where no candidate reproduces a probe (a
    torch whose packing this module does not know)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (_PROBE_ROWS, 64), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    if packed.numel() != q.numel() // 2:  # not one nibble a weight: another packing
        return None
    for bn in _CANDIDATE_BLOCK_N:
        for halves in (True, False):
            candidate = Layout(bn, halves)
            if torch.equal(_unpack(packed, _PROBE_ROWS, 64, candidate), q):
                return candidate
    return None


def _split(
    packed: torch.Tensor, num_rows: int, k: int, bn: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Views of a [num_rows, k] packing's whole blocks [num_rows // bn, k, bn / 2] and of its
    short last block [1, k, (num_rows % bn) / 2]; None where there is none."""
    flat = packed.reshape(-1)
    num_full, num_short = divmod(num_rows, bn)
    split = num_full * k * bn // 2
    full = flat[:split].view(num_full, k, bn // 2) if num_full else None
    short = flat[split:].view(1, k, num_short // 2) if num_short else None
    return full, short


def _unpack(packed: torch.Tensor, num_rows: int, k: int, lay: Layout) -> torch.Tensor:
    """All 4-bit values (0..15) of a [num_rows, k] packing: [num_rows, k] uint8, block by
    block (no gathers)."""
    full, short = _split(packed, num_rows, k, lay.block_n)
    parts = [] if full is None else [_block_values(full, lay.halves)]
    if short is not None:
        parts.append(_block_values(short, False))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _block_values(blocks: torch.Tensor, halves: bool) -> torch.Tensor:
    """blocks [num_blocks, k, w] bytes → their rows' values [num_blocks * 2w, k]."""
    lo, hi = blocks & 0x0F, blocks >> 4
    q = torch.cat([lo, hi], dim=2) if halves else torch.stack([lo, hi], dim=3).flatten(2)
    return q.transpose(1, 2).reshape(-1, blocks.shape[1])  # [nb, 2w, k]: rows in order


def _nibbles(packed: torch.Tensor, ids: torch.Tensor, num_rows: int, k: int) -> torch.Tensor:
    """The 4-bit values (0..15) of rows `ids` of a [num_rows, k] packing: [len(ids), k] int32."""
    lay = layout()
    assert lay is not None, "int4 rows read from a packing whose layout is unknown"
    bn = lay.block_n
    full, short = _split(packed, num_rows, k, bn)
    if short is None:  # whole blocks only: a decode step's lookups, in the fewest ops
        return _block_nibbles(full, ids, bn, lay.halves)
    first_short = num_rows // bn * bn  # the short last block's first row
    in_short = _block_nibbles(short, (ids - first_short).clamp(min=0), bn, False)
    if full is None:
        return in_short
    in_full = ids < first_short
    return torch.where(
        in_full[:, None], _block_nibbles(full, ids * in_full, bn, lay.halves), in_short
    )


def _block_nibbles(blocks: torch.Tensor, ids: torch.Tensor, bn: int, halves: bool) -> torch.Tensor:
    """Rows `ids` of blocks [num_blocks, k, w] of bn rows each (the last may hold 2w < bn),
    paired in halves or as neighbours: [len(ids), k] int32 of 0..15."""
    r = ids % bn
    pos, high = (r % (bn // 2), r >= bn // 2) if halves else (r // 2, r % 2 == 1)
    sel = blocks[ids // bn, :, pos].to(torch.int32)  # [n, k]
    return torch.where(high[:, None], sel >> 4, sel & 0x0F)


def rows(
    packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, num_rows: int, k_repeat: int
) -> torch.Tensor:
    """Rows `ids` of the weight a packed int4 Linear holds, as float32 [len(ids), K / k_repeat].

    packed: the int4 packing of q [num_rows, K]; scales: [K / 32, num_rows, 2] (scale, zero),
    w = (q - 8) * scale + zero; k_repeat: how many times the input is read (Q8_0 held as
    two int4 halves), whose weights add up.
    """
    q = _nibbles(packed, ids, num_rows, scales.shape[0] * GROUP)  # [n, K]
    return _weights(q, scales[:, ids, :], k_repeat)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, num_rows: int, k_repeat: int
) -> torch.Tensor:
    """The whole weight as float32 [num_rows, K / k_repeat], unpacked block by block (no
    gathers): what a wide prompt chunk's float32 GEMM takes instead of a copy kept."""
    lay = layout()
    assert lay is not None, "int4 weight dequantized from a packing whose layout is unknown"
    q = _unpack(packed, num_rows, scales.shape[0] * GROUP, lay)
    return _weights(q, scales, k_repeat)


def _weights(q: torch.Tensor, scales: torch.Tensor, k_repeat: int) -> torch.Tensor:
    """w = (q - 8) * scale + zero, the k_repeat parts summed: q [n, K] of 0..15, scales
    [K / 32, n, 2] → float32 [n, K / k_repeat]."""
    n, k = q.shape
    pairs = scales.float().transpose(0, 1)  # [n, K / 32, 2]
    w = (q.reshape(n, k // GROUP, GROUP).float() - 8).mul_(pairs[..., :1]).add_(pairs[..., 1:])
    w = w.reshape(n, k)
    return w if k_repeat == 1 else w.view(n, k_repeat, k // k_repeat).sum(dim=1)
