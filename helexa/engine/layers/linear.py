"""Linear layers whose weights may arrive as float tensors or as GGUF quantized blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from helexa.engine.loader.gguf import GGUFTensor


class Linear(nn.Module):
    """y = x @ W.T (+ b). W is [out_features, in_features] like torch/HF."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.has_bias = bias

    def load_weight(
        self, src: torch.Tensor | GGUFTensor, *, dtype: torch.dtype, quant: str | None = None
    ) -> None:
        """Take the weight from a float tensor or a GGUF tensor (dequantized here)."""
        w = src if isinstance(src, torch.Tensor) else src.dequantize(torch.float32)
        assert tuple(w.shape) == (self.out_features, self.in_features), (
            f"weight shape {tuple(w.shape)} != {(self.out_features, self.in_features)}"
        )
        self.weight = w.to(dtype).contiguous()

    def load_bias(self, b: torch.Tensor, *, dtype: torch.dtype) -> None:
        assert tuple(b.shape) == (self.out_features,), f"bias shape {tuple(b.shape)}"
        self.bias = b.to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return torch.nn.functional.linear(x, self.weight, self.bias)
