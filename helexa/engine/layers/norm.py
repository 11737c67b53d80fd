"""RMSNorm as Llama/Qwen define it (computed in float32, cast back), optionally fused with
the residual add before it: `helexa.kernels.rms_norm` (Triton on CUDA, torch on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from helexa import kernels
from helexa.engine.layers import native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> RMSNorm(x); with a residual (as x), the residual stream's next
        value comes back too: (RMSNorm(x + residual), x + residual)."""
        if native.usable(x, self.weight, *(() if residual is None else (residual,))):
            return native.rms_norm(x, self.weight, self.eps, residual)
        return kernels.rms_norm(x, self.weight, self.eps, residual)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); with no residual yet (the first layer's
        input), (RMSNorm(x), x)."""
        if residual is None:
            return self.forward(x), x
        return self.forward(x, residual)
