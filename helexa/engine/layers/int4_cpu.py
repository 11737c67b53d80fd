"""Reading single rows out of torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`)
without dequantizing the whole weight: how the token embeddings share a tied lm_head's
packed table instead of holding a float copy of it.

The packing interleaves blocks of BLOCK_N output rows: [N / BLOCK_N, K, BLOCK_N / 2] bytes,
the low nibble of column j holding row j of the block and the high nibble row j + BLOCK_N/2.
BLOCK_N follows the CPU's vector width (64 with AVX-512, 32 with AVX2), so it is found by
packing a probe once per process rather than assumed.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32  # int4 group along K: one scale and zero per 32 weights
_CANDIDATE_BLOCK_N = (64, 32, 16, 8)


@functools.cache
def block_n(num_rows: int) -> int | None:
    """The interleave of a [num_rows, K] packing on this CPU, or None where no candidate
    reproduces a probe (a torch whose layout this module does not know)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (num_rows, 64), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    ids = torch.arange(num_rows)
    if packed.numel() != num_rows * 32:  # not one nibble a weight: another packing
        return None
    for bn in _CANDIDATE_BLOCK_N:
        if num_rows % bn == 0 and torch.equal(_nibbles(packed, ids, bn, 64), q):
            return bn
    return None


def _nibbles(packed: torch.Tensor, ids: torch.Tensor, bn: int, k: int) -> torch.Tensor:
    """The 4-bit values (0..15) of rows `ids`: [len(ids), k] int32."""
    half = bn // 2
    blocks = packed.view(-1, k, half)  # [N / bn, k, bn / 2]
    j = ids % bn
    sel = blocks[ids // bn, :, j % half].to(torch.int32)  # [n, k]
    return torch.where((j < half)[:, None], sel & 0x0F, sel >> 4)


def rows(
    packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, num_rows: int, k_repeat: int
) -> torch.Tensor:
    """Rows `ids` of the weight a packed int4 Linear holds, as float32 [len(ids), K / k_repeat].

    packed: the int4 packing of q [num_rows, K]; scales: [K / 32, num_rows, 2] (scale, zero),
    w = (q - 8) * scale + zero; k_repeat: how many times the input is read (Q8_0 held as
    two int4 halves), whose weights add up.
    """
    bn = block_n(num_rows)
    assert bn is not None, "rows() called on a packing whose layout is unknown"
    q = _nibbles(packed, ids, bn, scales.shape[0] * GROUP)  # [n, K]
    return _weights(q, scales[:, ids, :], k_repeat)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, num_rows: int, k_repeat: int
) -> torch.Tensor:
    """The whole weight as float32 [num_rows, K / k_repeat], unpacked block by block (no
    gathers): what a wide prompt chunk's float32 GEMM takes instead of a copy kept."""
    bn = block_n(num_rows)
    assert bn is not None, "dequantize() called on a packing whose layout is unknown"
    k = scales.shape[0] * GROUP
    blocks = packed.view(num_rows // bn, k, bn // 2)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)  # [N / bn, k, bn]: rows j, j + bn/2
    return _weights(q.transpose(1, 2).reshape(num_rows, k), scales, k_repeat)


def _weights(q: torch.Tensor, scales: torch.Tensor, k_repeat: int) -> torch.Tensor:
    """w = (q - 8) * scale + zero, the k_repeat parts summed: q [n, K] of 0..15, scales
    [K / 32, n, 2] → float32 [n, K / k_repeat]."""
    n, k = q.shape
    pairs = scales.float().transpose(0, 1)  # [n, K / 32, 2]
    w = (q.reshape(n, k // GROUP, GROUP).float() - 8).mul_(pairs[..., :1]).add_(pairs[..., 1:])
    w = w.reshape(n, k)
    return w if k_repeat == 1 else w.view(n, k_repeat, k // k_repeat).sum(dim=1)
