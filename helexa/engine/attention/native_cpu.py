"""Attention on a CPU with the native kernels (layers/native.py): SDPA's path, but decode
rows read their blocks in place, float32 or float16, in one C call, rather than gathering
them for SDPA. Chosen for a float32 model on the CPU where the kernels build (and neither
`kernels` nor `cpu_kernels` asks for another path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from helexa.engine.attention.sdpa import SdpaAttention
from helexa.engine.layers import native

if TYPE_CHECKING:
    from helexa.engine.layers.attention import AttentionContext, PagedAttention


class NativeAttention(SdpaAttention):
    name = "native"

    @staticmethod
    def usable(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether the native decode kernel takes this runner's queries and caches."""
        probe = torch.empty(0, dtype=dtype, device=device)
        cache = torch.empty(0, dtype=kv_dtype, device=device)
        return native.usable(probe, caches=(cache,))

    def decode_mask(self, lens: torch.Tensor, span: int) -> torch.Tensor | None:
        return None  # the kernel reads each row's length

    def decode(self, attn: PagedAttention, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return native.paged_decode(
            q, attn.k_cache, attn.v_cache, ctx.decode_blocks, ctx.decode_lens, attn.scale
        )
