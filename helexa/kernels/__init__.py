"""The kernels the model code calls, each routed to its Triton or its plain-torch version.

Rule: a call runs the Triton version when its first tensor is on CUDA and triton imports;
otherwise the `naive_*` one. The engine may override that once at start-up with
`set_backend`: "auto" (the rule), "naive" (always plain torch) or "triton" (always Triton; on
CPU tensors that means Triton's interpreter, TRITON_INTERPRET=1, which only tests want).
Nothing here reads the environment.

Shapes are in each function's docstring; the kernels live beside their twins in
causal_conv1d.py, gdn_gating.py, fused_moe.py and gated_delta_rule.py.
"""

from __future__ import annotations

import torch

from . import gated_delta_rule as gdr
from .causal_conv1d import (
    naive_causal_conv1d,
    naive_causal_conv1d_update,
    triton_causal_conv1d,
    triton_causal_conv1d_update,
)
from .fused_moe import moe_by_expert, naive_fused_moe, triton_fused_moe
from .gdn_gating import naive_gdn_gating, triton_gdn_gating

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

BACKENDS = ("auto", "naive", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose the backend for every later call: "auto", "naive" or "triton"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; supported: {BACKENDS}")
    if name == "triton" and not HAS_TRITON:
        raise RuntimeError("kernel backend 'triton' asked for, but triton is not installed")
    _backend = name


def backend() -> str:
    """The backend set by set_backend ("auto" unless changed)."""
    return _backend


def uses_triton(x: torch.Tensor) -> bool:
    """Whether a call whose first tensor is x runs the Triton version."""
    if _backend == "auto":
        return HAS_TRITON and x.is_cuda
    return _backend == "triton"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence's prompt: q, k [T, Hk, K]; v [T, Hv, V];
    g, beta [T, Hv]; initial_state [Hv, K, V] | None -> (o [T, Hv, V], state [Hv, K, V] fp32)."""
    fn = gdr.triton_chunk_gated_delta_rule if uses_triton(q) else gdr.naive_chunk_gated_delta_rule
    return fn(q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode step of N sequences: q, k [N, Hk, K]; v [N, Hv, V]; g, beta [N, Hv];
    state [S, Hv, K, V] fp32 pool, updated in place at rows state_indices [N] -> o [N, Hv, V]."""
    fn = (
        gdr.triton_fused_recurrent_gated_delta_rule
        if uses_triton(q)
        else gdr.naive_recurrent_gated_delta_rule
    )
    return fn(q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence: x [T, C], weight [C, W], bias [C] | None,
    initial_state [C, W-1] | None -> (out [T, C], final_state [C, W-1])."""
    fn = triton_causal_conv1d if uses_triton(x) else naive_causal_conv1d
    return fn(x, weight, bias, initial_state, activation=activation)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of N sequences: x [N, C], conv_state [S, C, W-1] pool updated in place
    at rows state_indices [N] (None: 0..N-1) -> out [N, C]."""
    fn = triton_causal_conv1d_update if uses_triton(x) else naive_causal_conv1d_update
    return fn(x, conv_state, weight, bias, state_indices, activation=activation)


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN gates: a, b [T, H]; A_log, dt_bias [H] -> (g, beta) fp32 [T, H]."""
    fn = triton_gdn_gating if uses_triton(a) else naive_gdn_gating
    return fn(A_log, a, b, dt_bias)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids [T, k]
    -> [T, H] in x.dtype."""
    fn = triton_fused_moe if uses_triton(x) else naive_fused_moe
    return fn(x, w13, w2, topk_weights, topk_ids)


__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "backend",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_moe",
    "fused_recurrent_gated_delta_rule",
    "gdn_gating",
    "moe_by_expert",
    "set_backend",
    "uses_triton",
]
