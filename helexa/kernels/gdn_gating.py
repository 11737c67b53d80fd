"""The GDN layers' per-head gates: decay g and write strength beta, from the a and b projections.

g = -exp(A_log) * softplus(a + dt_bias) (a log-decay, <= 0) and beta = sigmoid(b), both fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


SOFTPLUS_THRESHOLD = 20.0  # torch's: softplus(x) = x above it


def naive_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, H]; A_log, dt_bias: [H]. Returns g, beta: fp32 [T, H] (softplus as torch's)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    return g, beta


if triton is not None:

    @triton.jit
    def _gdn_gating_kernel(
        A_log_ptr, a_ptr, b_ptr, dt_bias_ptr, g_ptr, beta_ptr,
        num_tokens, num_heads,
        stride_at, stride_ah, stride_bt, stride_bh,
        THRESHOLD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_T tokens, all heads; g and beta are written contiguous [T, H]."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < num_heads
        mask = (offs_t < num_tokens)[:, None] & h_ok[None, :]
        A_log = tl.load(A_log_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + offs_t[:, None] * stride_at + offs_h[None, :] * stride_ah, mask=mask, other=0.0
        )
        b = tl.load(
            b_ptr + offs_t[:, None] * stride_bt + offs_h[None, :] * stride_bh, mask=mask, other=0.0
        )
        x = a.to(tl.float32) + dt_bias[None, :]
        # softplus = log1p(exp(x)); log1p(u) as log(1+u) * u / ((1+u) - 1), exact where 1+u
        # rounds (x < -17 would otherwise give 0 instead of exp(x))
        u = tl.exp(tl.minimum(x, THRESHOLD))
        w = 1.0 + u
        exact = w == 1.0
        softplus = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
        softplus = tl.where(x > THRESHOLD, x, softplus)
        g = -tl.exp(A_log)[None, :] * softplus
        beta = tl.sigmoid(b.to(tl.float32))
        offs = offs_t[:, None] * num_heads + offs_h[None, :]
        tl.store(g_ptr + offs, g, mask=mask)
        tl.store(beta_ptr + offs, beta, mask=mask)


def _launch_gdn_gating(A_log, a, b, dt_bias, g, beta) -> None:
    num_tokens, num_heads = a.shape
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, 2048 // block_h)
    grid = (triton.cdiv(num_tokens, block_t),)
    _gdn_gating_kernel[grid](
        A_log, a, b, dt_bias, g, beta,
        num_tokens, num_heads,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_T=block_t, BLOCK_H=block_h,
    )  # fmt: skip


def triton_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As naive_gdn_gating, in Triton: a, b [T, H] (any strides); A_log, dt_bias [H]
    contiguous -> (g, beta) fp32 [T, H]."""
    if triton is None:
        raise RuntimeError(
            "triton_gdn_gating needs triton, which is not installed; use naive_gdn_gating"
        )
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if a.shape[0] > 0:
        _launch_gdn_gating(A_log, a, b, dt_bias, g, beta)
    return g, beta
