"""Attention over the paged KV cache: the per-step metadata every layer shares, and the layer.

Each layer owns k/v caches shaped [num_blocks, block_size, num_kv_heads, head_dim], in the
model's dtype, or on the CPU float16 under a float32 model (`[engine] kv_cache_dtype`).
New tokens' K/V are written to their slots, then each token attends causally over its
sequence's context. How, is the attention backend's (helexa/engine/attention/): Triton
kernels, the native CPU kernels or torch SDPA, chosen once by the model runner for the
whole model, which hands it to every layer with its caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's chunk of new tokens: rows [start, end) of the flat batch."""

    start: int
    end: int
    # SDPA backends: slots of the whole context (cached prefix + this chunk), or None when
    # the chunk is the entire context so far and K/V can be used as computed.
    context_slots: torch.Tensor | None
    # For a later chunk off the CPU: query i sees keys up to span - length + i (built once
    # per step). On the CPU none: the prefix and the chunk attend apart (prefix_then_causal).
    mask: torch.Tensor | None = None
    state_slot: int = -1  # hybrid models: the sequence's row in the recurrent-state pools
    cached: int = 0  # tokens of the sequence before this chunk (0: the chunk starts it)


@dataclass(slots=True)
class AttentionContext:
    """Per-step attention metadata, built once by the model runner, shared by all layers.
    The fields past `decode_state_slots` are one backend's each (helexa/engine/attention)."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor
    prefills: list[PrefillSegment]
    decode_rows: torch.Tensor | None = None  # [num_decode] rows of the flat batch, or None
    all_decode: bool = False  # every row is a decode row, in order
    # hybrid models: [num_decode] the decode rows' rows in the recurrent-state pools
    decode_state_slots: torch.Tensor | None = None
    # [num_outputs] the rows whose hidden states are read after the last layer (the sampled
    # ones), where the model returns only those (`selects_output_rows`); None: every row
    output_rows: torch.Tensor | None = None
    # images: [num_spliced] rows of the flat batch whose embeddings the vision tower's output
    # [num_spliced, hidden] replaces (their token ids are image pads)
    splice_rows: torch.Tensor | None = None
    splice: torch.Tensor | None = None
    # SDPA and native: [num_decode, max_blocks] block tables padded with block 0 (whole
    # blocks are gathered: a few long contiguous copies rather than one short copy per
    # token), [num_decode] int32 tokens each row attends to, and whether some row ends short
    # of its blocks, for which SDPA masks: [num_decode, 1, 1, max_blocks * block_size]
    decode_blocks: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_ragged: bool = False
    decode_mask: torch.Tensor | None = None
    # Triton: every sequence of the step, in batch order. `context_lens` [B] int32 are
    # tokens after this step; `block_tables` [B, max_blocks] int32. `cu_seqlens_q` [B+1] int32
    # (new tokens per sequence, as offsets) is None on a decode-only step.
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1


class Backend(Protocol):
    """What a layer calls of its attention backend (helexa/engine/attention/base.py)."""

    def store(
        self, attn: PagedAttention, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor: ...


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # set by the model runner: the caches, and the backend that writes and reads them
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: Backend | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        k, v = self.backend.store(self, k, v, ctx)
        return self.backend.forward(self, q, k, v, ctx)
