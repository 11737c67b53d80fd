"""Attention backends, one per execution path (as vLLM's), chosen once by the model runner.

- TritonAttention (triton_paged.py): CUDA, or `kernels = "triton"`; the paged kernels read
  the cache through block tables, K/V stored by `kernels.store_kv`; CUDA-graph safe.
- NativeAttention (native_cpu.py): a float32 model on a CPU where layers/native.py builds;
  decode rows read their blocks in place.
- SdpaAttention (sdpa.py): plain torch, the reference: context gathered, then SDPA.

`base.AttentionBackend` is what each provides; `PagedAttention.forward` is its store, then
its forward.
"""

from __future__ import annotations

import torch

from helexa import kernels
from helexa.engine.attention.base import AttentionBackend
from helexa.engine.attention.native_cpu import NativeAttention
from helexa.engine.attention.sdpa import SdpaAttention
from helexa.engine.attention.triton_paged import TritonAttention


def select_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int
) -> AttentionBackend:
    """The backend for a model of `dtype` on `device` with a `kv_dtype` cache: Triton where
    helexa.kernels runs Triton on the device, else native where it takes the model, else
    SDPA."""
    if kernels.triton_on(device):
        cls: type[AttentionBackend] = TritonAttention
    elif NativeAttention.usable(device, dtype, kv_dtype):
        cls = NativeAttention
    else:
        cls = SdpaAttention
    return cls(device, dtype, block_size)


__all__ = [
    "AttentionBackend",
    "NativeAttention",
    "SdpaAttention",
    "TritonAttention",
    "select_backend",
]
