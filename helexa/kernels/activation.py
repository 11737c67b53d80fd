"""SwiGLU's activation: silu(gate) * up from one fused gate|up projection.

x [T, 2I] holds gate in its first I columns and up in the last I; out [T, I]. silu is
computed in fp32 and rounded to x's dtype before the product, as torch's F.silu(gate).mul_(up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def naive_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row, BLOCK columns of out; out is contiguous [T, I]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu's value, in x's dtype
        out = silu.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * inter + cols, out.to(gate.dtype), mask=ok)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As naive_silu_and_mul, in Triton: x [..., 2I] (rows may be strided) -> new contiguous
    [..., I] in x.dtype."""
    if triton is None:
        raise RuntimeError(
            "triton_silu_and_mul needs triton, which is not installed; use naive_silu_and_mul"
        )
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])  # a view where it can be (strided rows stay strided)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out.numel() > 0:
        block = min(triton.next_power_of_2(inter), 1024)
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](rows, out, inter, rows.stride(0), BLOCK=block, num_warps=4)
    return out
