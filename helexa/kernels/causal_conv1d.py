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
    # xpad: [T + W - 1, C]
    xpad = torch.cat([initial_state.T.to(x.dtype), x], dim=0)
    out = F.conv1d(
        xpad.T.unsqueeze(0).float(),
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
    window = torch.cat([conv_state[state_indices].to(x.dtype), x.unsqueeze(-1)], dim=-1)
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    conv_state[state_indices] = window[:, :, 1:].to(conv_state.dtype)
    return out.to(x.dtype)


def triton_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """As naive_causal_conv1d, in Triton."""
    raise NotImplementedError("triton_causal_conv1d: not written yet")


def triton_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As naive_causal_conv1d_update, in Triton."""
    raise NotImplementedError("triton_causal_conv1d_update: not written yet")
