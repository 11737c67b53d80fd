"""The GDN layers' per-head gates: decay g and write strength beta, from the a and b projections.

g = -exp(A_log) * softplus(a + dt_bias) (a log-decay, <= 0) and beta = sigmoid(b), both fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def naive_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, H]; A_log, dt_bias: [H]. Returns g, beta: fp32 [T, H] (softplus as torch's)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    return g, beta


def triton_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As naive_gdn_gating, in Triton."""
    raise NotImplementedError("triton_gdn_gating: not written yet")
