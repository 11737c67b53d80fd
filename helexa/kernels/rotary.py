"""Rotary position embedding of q and k, rotate-half layout (as HF stores Llama/Qwen weights).

Each head's first R dims (R = rotary_dim, even, <= head_dim; Qwen3.5 rotates a quarter) are
rotated: out = x * cos + rotate_half(x) * sin, where rotate_half([x1, x2]) = [-x2, x1]. The
tables hold the sign already (`signed_sin` = [-sin, sin] over the two halves), so
out = x * cos + [x2, x1] * signed_sin. Dims past R pass through. Products round as torch's
do: x * cos to x's dtype, then the second product added in fp32 and rounded once (addcmul).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    n, heads, d = x.shape
    swapped = x.reshape(n, heads, 2, d // 2).flip(2).view(n, heads, d)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, signed_sin)


def naive_apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """x [T, H, D]; cos, signed_sin [T, 1, R], R <= D even -> new [T, H, D]."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return _rotate(x, cos, signed_sin)
    return torch.cat((_rotate(x[..., :rd], cos, signed_sin), x[..., rd:]), dim=-1)


def naive_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; cos, signed_sin [T, 1, R] -> new (q, k)."""
    return naive_apply_rotary(q, cos, signed_sin), naive_apply_rotary(k, cos, signed_sin)


if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr, o_ptr, cos_ptr, sin_ptr, tok, head0, num_heads, stride_x0, stride_x1,
        stride_c, stride_s, head_dim,
        HALF: tl.constexpr, PASS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        """Heads head0.. head0+BLOCK_H of token tok: rotate the first 2*HALF dims, copy the
        next PASS; out is contiguous [T, num_heads, head_dim]."""
        heads = head0 + tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < HALF
        mask = (heads < num_heads)[:, None] & r_ok[None, :]
        tok64 = tok.to(tl.int64)
        x_row = x_ptr + tok64 * stride_x0 + heads.to(tl.int64)[:, None] * stride_x1
        o_row = o_ptr + (tok64 * num_heads + heads.to(tl.int64))[:, None] * head_dim
        x1 = tl.load(x_row + r[None, :], mask=mask, other=0.0)
        x2 = tl.load(x_row + HALF + r[None, :], mask=mask, other=0.0)
        c1 = tl.load(cos_ptr + tok64 * stride_c + r, mask=r_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tok64 * stride_c + HALF + r, mask=r_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tok64 * stride_s + r, mask=r_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tok64 * stride_s + HALF + r, mask=r_ok, other=0.0).to(tl.float32)
        dt = x1.dtype
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        a1 = (x1 * c1[None, :]).to(dt).to(tl.float32)  # x * cos, a tensor of x's dtype
        a2 = (x2 * c2[None, :]).to(dt).to(tl.float32)
        tl.store(o_row + r[None, :], (a1 + x2 * s1[None, :]).to(dt), mask=mask)
        tl.store(o_row + HALF + r[None, :], (a2 + x1 * s2[None, :]).to(dt), mask=mask)
        if PASS > 0:
            p = tl.arange(0, BLOCK_P)
            p_mask = (heads < num_heads)[:, None] & (p < PASS)[None, :]
            rest = tl.load(x_row + 2 * HALF + p[None, :], mask=p_mask, other=0.0)
            tl.store(o_row + 2 * HALF + p[None, :], rest, mask=p_mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
        num_q_heads, num_k_heads, head_dim,
        stride_q0, stride_q1, stride_k0, stride_k1, stride_c, stride_s,
        HALF: tl.constexpr, PASS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        """Grid (tokens, q head blocks + k head blocks): one launch rotates both."""
        tok = tl.program_id(0)
        block = tl.program_id(1)
        q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
        if block < q_blocks:
            _rotate_heads(
                q_ptr, qo_ptr, cos_ptr, sin_ptr, tok, block * BLOCK_H, num_q_heads,
                stride_q0, stride_q1, stride_c, stride_s, head_dim,
                HALF, PASS, BLOCK_H, BLOCK_R, BLOCK_P,
            )  # fmt: skip
        else:
            _rotate_heads(
                k_ptr, ko_ptr, cos_ptr, sin_ptr, tok, (block - q_blocks) * BLOCK_H, num_k_heads,
                stride_k0, stride_k1, stride_c, stride_s, head_dim,
                HALF, PASS, BLOCK_H, BLOCK_R, BLOCK_P,
            )  # fmt: skip


def _launch_rotary(q, k, cos, sin, q_out, k_out) -> None:
    num_tokens, hq, head_dim = q.shape
    hk = k.shape[1]
    half = cos.shape[-1] // 2
    rest = head_dim - 2 * half
    block_r = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(hq, hk)), max(1, 1024 // block_r))
    grid = (num_tokens, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    _rotary_kernel[grid](
        q, k, q_out, k_out, cos, sin, hq, hk, head_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, PASS=rest, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_P=triton.next_power_of_2(max(rest, 1)), num_warps=4,
    )  # fmt: skip


def triton_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As naive_rotary, in one Triton launch: q [T, Hq, D], k [T, Hk, D] (views of a fused
    qkv are fine: any token and head strides); cos, signed_sin [T, 1, R] -> new contiguous
    (q, k)."""
    if triton is None:
        raise RuntimeError("triton_rotary needs triton, which is not installed; use naive_rotary")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    signed_sin = signed_sin if signed_sin.stride(-1) == 1 else signed_sin.contiguous()
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if q.shape[0] > 0:
        _launch_rotary(q, k, cos, signed_sin, q_out, k_out)
    return q_out, k_out
