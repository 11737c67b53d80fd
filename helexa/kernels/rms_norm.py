"""RMSNorm as Llama/Qwen define it, optionally after adding the residual stream.

out = RMSNorm(x) = weight * (x / sqrt(mean(x^2) + eps)), computed in fp32. For x in a 16-bit
dtype the normalised value is rounded to x's dtype before the weight multiplies it, as HF
does; for fp32 x it is torch's F.rms_norm. With a residual: new_residual = x + residual
(rounded to x's dtype, as the unfused `x + residual` is) and out = RMSNorm(new_residual).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def naive_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D]; weight [D]; residual None or as x -> out [..., D], or (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:  # one fused torch kernel; the same math as below
        out = F.rms_norm(x, weight.shape, weight, eps)
    else:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        num_rows, inner, dim, eps,
        stride_x0, stride_x1, stride_r0, stride_r1,
        HAS_RESIDUAL: tl.constexpr, ROUND_TO_X: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_M rows of D. Row r of x sits at (r // inner) * stride_x0 + (r % inner) *
        stride_x1 (a [T, H, D] view of heads, or [T, D] with inner = 1); out and res_out
        are contiguous [rows, D]."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & (cols < dim)[None, :]
        outer, within = (rows // inner).to(tl.int64), (rows % inner).to(tl.int64)
        x_offs = (outer * stride_x0 + within * stride_x1)[:, None] + cols[None, :]
        x_in = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        out_offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]
        x = x_in.to(tl.float32)
        if HAS_RESIDUAL:
            r_offs = (outer * stride_r0 + within * stride_r1)[:, None] + cols[None, :]
            r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
            summed = (x + r.to(tl.float32)).to(x_in.dtype)  # as torch's x + residual rounds
            tl.store(res_out_ptr + out_offs, summed, mask=mask)
            x = summed.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
        h = x * rstd[:, None]
        if ROUND_TO_X:  # HF: weight * h.to(x.dtype)
            h = h.to(x_in.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
        out = h * w[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """t as rows of its last dim: (t or a copy, inner, stride0, stride1); see the kernel."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t, 1, t.stride(0), 0


def _launch_rms_norm(x, weight, eps, residual, out, res_out) -> None:
    dim = x.shape[-1]
    num_rows = x.numel() // dim
    x, inner, sx0, sx1 = _rows(x)
    if residual is not None:
        residual, _, sr0, sr1 = _rows(residual)  # x's shape, so x's inner
    else:
        sr0 = sr1 = 0
    block_d = triton.next_power_of_2(dim)
    block_m = max(1, min(triton.next_power_of_2(num_rows), 4096 // block_d))
    num_warps = min(16, max(1, block_m * block_d // 512))
    grid = (triton.cdiv(num_rows, block_m),)
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out,
        num_rows, inner, dim, eps, sx0, sx1, sr0, sr1,
        HAS_RESIDUAL=residual is not None, ROUND_TO_X=x.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip


def triton_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As naive_rms_norm, in one Triton pass: x [..., D] (a [T, H, D] view of heads may be
    strided), weight [D] contiguous, residual None or as x -> out [..., D] contiguous (dtype
    as weight * x promotes), or (out, new_residual [..., D] in x.dtype)."""
    if triton is None:
        raise RuntimeError(
            "triton_rms_norm needs triton, which is not installed; use naive_rms_norm"
        )
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x.numel() > 0:
        _launch_rms_norm(x, weight, eps, residual, out, res_out)
    return out if residual is None else (out, res_out)
