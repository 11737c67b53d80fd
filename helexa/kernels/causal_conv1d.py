"""Depthwise causal 1-D convolution of the GDN layers (Qwen3.5 / Qwen3-Next linear attention).

Two entry points, each as `naive_*` (plain torch) and `triton_*`:
- `*_causal_conv1d`: one sequence's prompt (or one chunk of it), returning the state to carry on;
- `*_causal_conv1d_update`: one decode step of N sequences against a pool of conv states.

Both compute out[t, c] = act(bias[c] + sum_j weight[c, j] * xpad[t + j, c]), where xpad is the
W-1 inputs that came before (the conv state) followed by x; W is the kernel width (4 in Qwen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None

ACTIVATIONS = ("silu", None)


def _check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {ACTIVATIONS}")


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, whole prompt (or one chunk of it), in plain torch.

    x: [T, C]; weight: [C, W] (depthwise); bias: [C] | None; initial_state: [C, W-1], the W-1
    inputs before x (None: zeros). Returns out [T, C] in x.dtype and final_state [C, W-1] (the
    last W-1 rows of initial_state.T ++ x, so T < W-1 works) in the state's dtype.
    """
    _check_activation(activation)
    num_tokens, num_channels = x.shape
    width = weight.shape[1]
    if initial_state is None:
        initial_state = x.new_zeros(num_channels, width - 1)
    # xpad: [T + W - 1, C], fp32 so that a state kept in another dtype is not rounded to x's
    xpad = torch.cat([initial_state.T.float(), x.float()], dim=0)
    out = F.conv1d(
        xpad.T.unsqueeze(0),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=num_channels,
    )[0].T  # [T, C]
    if activation == "silu":
        out = F.silu(out)
    final_state = xpad[num_tokens:].T.to(initial_state.dtype).contiguous()
    return out.to(x.dtype), final_state


def naive_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of N sequences, in plain torch.

    x: [N, C]; conv_state: [S, C, W-1] pool, updated in place at rows state_indices [N] int64
    (None: rows 0..N-1) by shifting in x; weight: [C, W]; bias: [C] | None. Returns out [N, C].
    """
    _check_activation(activation)
    if state_indices is None:
        state_indices = torch.arange(x.shape[0], device=x.device)
    # window: [N, C, W]
    window = torch.cat([conv_state[state_indices].float(), x.float().unsqueeze(-1)], dim=-1)
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    conv_state[state_indices] = window[:, :, 1:].to(conv_state.dtype)
    return out.to(x.dtype)


if triton is not None:

    @triton.jit
    def _causal_conv1d_kernel(
        x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr,
        num_tokens, num_channels,
        stride_xt, stride_xc, stride_wc, stride_ww, stride_sc, stride_sw, stride_ot, stride_oc,
        HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
        WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_T, BLOCK_C] tile of out; tap j reads x row t + j - (W-1), or the state
        column t + j when that row is before x."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok = offs_t < num_tokens
        c_ok = offs_c < num_channels
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(WIDTH):
            w = tl.load(weight_ptr + offs_c * stride_wc + j * stride_ww, mask=c_ok, other=0.0)
            src = offs_t + (j - (WIDTH - 1))  # the x row this tap reads; < 0: in the state
            in_x = (src >= 0) & t_ok
            xv = tl.load(
                x_ptr + src[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                mask=in_x[:, None] & c_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_STATE:
                in_state = (src < 0) & t_ok
                xv += tl.load(
                    state_ptr
                    + offs_c[None, :] * stride_sc
                    + (src + WIDTH - 1)[:, None] * stride_sw,
                    mask=in_state[:, None] & c_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
            acc += w.to(tl.float32)[None, :] * xv
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + offs_t[:, None] * stride_ot + offs_c[None, :] * stride_oc,
            acc.to(out_ptr.dtype.element_ty),
            mask=t_ok[:, None] & c_ok[None, :],
        )

    @triton.jit
    def _causal_conv1d_update_kernel(
        x_ptr, state_ptr, indices_ptr, weight_ptr, bias_ptr, out_ptr,
        num_channels,
        stride_xn, stride_xc, stride_ss, stride_sc, stride_sw, stride_wc, stride_ww,
        stride_on, stride_oc,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """One sequence's BLOCK_C channels: the window is its W-1 state columns then x; each
        value read (but the oldest) is written one column to the left."""
        n = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < num_channels
        row = tl.load(indices_ptr + n).to(tl.int64)
        state_row = state_ptr + row * stride_ss + offs_c * stride_sc
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        for j in tl.static_range(WIDTH):
            if j < WIDTH - 1:
                v = tl.load(state_row + j * stride_sw, mask=c_ok, other=0.0)
            else:
                v = tl.load(x_ptr + n * stride_xn + offs_c * stride_xc, mask=c_ok, other=0.0)
            w = tl.load(weight_ptr + offs_c * stride_wc + j * stride_ww, mask=c_ok, other=0.0)
            acc += w.to(tl.float32) * v.to(tl.float32)
            if j > 0:  # column j-1 was read an iteration ago: shift v into it
                tl.store(
                    state_row + (j - 1) * stride_sw, v.to(state_ptr.dtype.element_ty), mask=c_ok
                )
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + n * stride_on + offs_c * stride_oc,
            acc.to(out_ptr.dtype.element_ty),
            mask=c_ok,
        )


def _require_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton, which is not installed; use naive_{name[7:]}")


def _launch_causal_conv1d(x, weight, bias, initial_state, out, silu: bool) -> None:
    num_tokens, num_channels = x.shape
    block_t, block_c = 32, 64
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_channels, block_c))
    state = initial_state if initial_state is not None else x  # a placeholder pointer
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else x, state, out,
        num_tokens, num_channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        state.stride(0), state.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, HAS_STATE=initial_state is not None, SILU=silu,
        WIDTH=weight.shape[1], BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip


def _launch_causal_conv1d_update(x, conv_state, state_indices, weight, bias, out, silu) -> None:
    num_seqs, num_channels = x.shape
    block_c = 256
    grid = (num_seqs, triton.cdiv(num_channels, block_c))
    _causal_conv1d_update_kernel[grid](
        x, conv_state, state_indices, weight, bias if bias is not None else x, out,
        num_channels,
        x.stride(0), x.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SILU=silu,
        WIDTH=weight.shape[1], BLOCK_C=block_c,
    )  # fmt: skip


def triton_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """As naive_causal_conv1d, in Triton: x [T, C], weight [C, W], bias [C] | None,
    initial_state [C, W-1] | None -> (out [T, C] in x.dtype, final_state [C, W-1])."""
    _require_triton("triton_causal_conv1d")
    _check_activation(activation)
    num_tokens, num_channels = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        _launch_causal_conv1d(x, weight, bias, initial_state, out, activation == "silu")
    # the state to carry on is a copy of the last W-1 inputs: a few columns, no kernel needed
    if initial_state is None:
        initial_state = x.new_zeros(num_channels, width - 1)
    tail = x[max(0, num_tokens - (width - 1)) :].T.to(initial_state.dtype)
    final_state = torch.cat([initial_state, tail], dim=1)[:, tail.shape[1] :].contiguous()
    return out, final_state


def triton_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As naive_causal_conv1d_update, in Triton: x [N, C], conv_state [S, C, W-1] updated in
    place at rows state_indices [N] (None: 0..N-1, distinct) -> out [N, C]."""
    _require_triton("triton_causal_conv1d_update")
    _check_activation(activation)
    num_seqs = x.shape[0]
    if state_indices is None:
        state_indices = torch.arange(num_seqs, device=x.device)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    _launch_causal_conv1d_update(
        x, conv_state, state_indices, weight, bias, out, activation == "silu"
    )
    return out
