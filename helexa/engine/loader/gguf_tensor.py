"""One GGUF tensor as the file stores it (its own module: the loader's per-architecture and
tensor-parallel modules read it without importing the loader)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.engine.loader.dequant import dequantize


@dataclass(slots=True)
class GGUFTensor:
    """One tensor as stored in the file: raw bytes plus how to read them."""

    name: str  # HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
    qtype: str  # a key of dequant.FORMATS: "F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", ...
    shape: tuple[int, ...]  # torch/HF order, e.g. (out_features, in_features)
    data: torch.Tensor  # uint8 [prod(shape[:-1]), bytes_per_row]; 1-D tensors: [1, bytes]

    def dequantize(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The weights as `dtype`, of `shape`; with `device`, the raw bytes move there first."""
        data = self.data if device is None else self.data.to(device)
        return dequantize(data, self.qtype, self.shape).to(dtype)
