"""Attention over the paged KV cache.

Each layer owns k/v caches shaped [num_blocks, block_size, num_kv_heads, head_dim], in the
model's dtype, or on the CPU float16 under a float32 model (`[engine] kv_cache_dtype`): the
torch path then widens what it reads, the native kernels read halves in place.
New tokens' K/V are written to their slots, then each token attends causally over its
sequence's context. Two paths, chosen by the model runner for the whole step:

- Triton kernels (CUDA; `kernels.paged_decode_attention` / `paged_prefill_attention`): the
  context is read through block tables, never gathered. A decode-only step is one decode
  call (CUDA-graph safe); any other step is one varlen prefill call over every sequence,
  decode rows included as one-token chunks.
- Plain torch (CPU, and the reference): prefill segments gather their context and run
  SDPA; decode rows gather whole blocks and run one batched SDPA, or on a CPU with the
  native kernels (layers/native.py) one call that reads the blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from helexa import kernels
from helexa.engine.layers import native


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's chunk of new tokens: rows [start, end) of the flat batch."""

    start: int
    end: int
    # Slots of the whole context (cached prefix + this chunk), or None when the chunk is
    # the entire context so far and K/V can be used as computed (torch path only).
    context_slots: torch.Tensor | None
    # For a later chunk off the CPU: query i sees keys up to span - length + i (built once
    # per step). On the CPU none: the prefix and the chunk attend apart (prefix_then_causal).
    mask: torch.Tensor | None = None
    state_slot: int = -1  # hybrid models: the sequence's row in the recurrent-state pools
    cached: int = 0  # tokens of the sequence before this chunk (0: the chunk starts it)


@dataclass(slots=True)
class AttentionContext:
    """Per-step attention metadata, built once by the model runner, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor
    prefills: list[PrefillSegment]
    decode_rows: torch.Tensor | None  # [num_decode] rows of the flat batch, or None
    # [num_decode, max_blocks] block tables padded with block 0: whole blocks are gathered
    # (a few long contiguous copies rather than one short copy per token).
    decode_blocks: torch.Tensor | None
    # [num_decode, 1, 1, max_blocks * block_size], 0 / -inf: built from decode_lens by the
    # first layer whose SDPA needs it (`decode_ragged`: some row ends short of its blocks)
    decode_mask: torch.Tensor | None
    decode_lens: torch.Tensor | None = None  # [num_decode] int32 tokens each row attends to
    decode_ragged: bool = False
    all_decode: bool = False  # every row is a decode row, in order
    # hybrid models: [num_decode] the decode rows' rows in the recurrent-state pools
    decode_state_slots: torch.Tensor | None = None
    # Triton path: every sequence of the step, in batch order. `context_lens` [B] int32 are
    # tokens after this step; `block_tables` [B, max_blocks] int32. `cu_seqlens_q` [B+1] int32
    # (new tokens per sequence, as offsets) is None on a decode-only step.
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1
    # [num_outputs] the rows whose hidden states are read after the last layer (the sampled
    # ones), where the model returns only those (`selects_output_rows`); None: every row
    output_rows: torch.Tensor | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        kvh, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        k_flat = self.k_cache.view(-1, kvh, d)
        v_flat = self.v_cache.view(-1, kvh, d)
        # A float16 cache under a float32 model (the CPU's default): the new tokens attend
        # over the values the cache holds, as every later step will, so that a prompt gives
        # the same logits computed whole, in chunks or after a cached prefix. (Each .to is
        # a no-op where the dtypes agree.)
        k, v = k.to(k_flat.dtype), v.to(v_flat.dtype)
        k_flat.index_copy_(0, ctx.slot_mapping, k)
        v_flat.index_copy_(0, ctx.slot_mapping, v)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if ctx.context_lens is not None:
            if ctx.cu_seqlens_q is None:
                return kernels.paged_decode_attention(
                    q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale
                )
            return kernels.paged_prefill_attention(
                q,
                self.k_cache,
                self.v_cache,
                ctx.cu_seqlens_q,
                ctx.context_lens,
                ctx.block_tables,
                self.scale,
                ctx.max_seqlen_q,
            )
        out = q.new_empty(q.shape)

        for seg in ctx.prefills:
            # 4-D, with a batch of one: torch's CPU flash kernel takes only 4-D inputs, and
            # 3-D ones fell to the math path (a masked 512-token chunk after 512 cached:
            # 28 ms a layer against 10 on the 2-core VM). K/V keep their kv heads: the
            # kernel reads each for its `group` query heads (enable_gqa), no repeat copied.
            qs = q[seg.start : seg.end].transpose(0, 1)[None]  # [1, H, L, D]
            ks, vs = k[seg.start : seg.end].transpose(0, 1)[None], v[seg.start : seg.end]
            vs = vs.transpose(0, 1)[None]  # [1, KVH, L, D]: the chunk's own keys and values
            if seg.context_slots is None:  # the chunk is the whole context
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            elif seg.mask is None:  # a later chunk on the CPU: the cached prefix, then itself
                prefix = seg.context_slots[: seg.cached]
                kp = k_flat[prefix].to(q.dtype).transpose(0, 1)[None]
                vp = v_flat[prefix].to(q.dtype).transpose(0, 1)[None]
                o = prefix_then_causal(qs, kp, vp, ks, vs, self.scale)
            else:
                ks = k_flat[seg.context_slots].to(q.dtype).transpose(0, 1)[None]
                vs = v_flat[seg.context_slots].to(q.dtype).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=seg.mask, scale=self.scale, enable_gqa=True
                )
            out[seg.start : seg.end] = o[0].transpose(0, 1)

        if ctx.decode_rows is not None:
            rows = ctx.decode_rows
            n = rows.shape[0]
            qd = q if ctx.all_decode else q[rows]
            if native.usable(qd, caches=(self.k_cache, self.v_cache)):  # read in place
                o = native.paged_decode(
                    qd, self.k_cache, self.v_cache, ctx.decode_blocks, ctx.decode_lens, self.scale
                )
                if ctx.all_decode:
                    return o
                out[rows] = o
                return out
            # Grouped-query trick: the `group` query heads sharing a kv head become the
            # query-length axis of that kv head, so no K/V repeat is needed.
            qd = qd.view(n, kvh, group, d)
            kd = self.k_cache[ctx.decode_blocks].to(qd.dtype).view(n, -1, kvh, d).transpose(1, 2)
            vd = self.v_cache[ctx.decode_blocks].to(qd.dtype).view(n, -1, kvh, d).transpose(1, 2)
            # kd, vd: [n, kvh, max_blocks * block_size, d]
            if ctx.decode_mask is None and ctx.decode_ragged:
                ctx.decode_mask = decode_mask(ctx.decode_lens, kd.shape[2], qd.dtype)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=ctx.decode_mask, scale=self.scale
            )
            o = o.reshape(n, self.num_heads, d)
            if ctx.all_decode:
                out = o
            else:
                out[rows] = o
        return out


def decode_mask(lens: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, 1, 1, span]: 0 where position < lens[row], else -inf; additive and in the
    queries' dtype, as SDPA would otherwise convert a bool mask again in every layer."""
    visible = torch.arange(span, device=lens.device) < lens[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=lens.device)
    return mask.masked_fill_(~visible, -torch.inf)[:, None, None, :]


# torch's CPU flash attention, which also returns each query's log-sum-exp of its scores
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_prefix_attention(device: torch.device) -> bool:
    """Whether a later prompt chunk on `device` attends as `prefix_then_causal` does, rather
    than through a [chunk, context] mask (which the model runner then need not build)."""
    return device.type == "cpu" and _FLASH_CPU is not None


def prefix_then_causal(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk's queries q [1, H, L, D] over a cached prefix [1, KVH, P, D],
    every key visible, and over the chunk's own keys [1, KVH, L, D], causally: two flash
    calls merged by their log-sum-exps. What one masked call over the concatenation gives
    (to float rounding), without the mask: the masked call computed every score of the
    chunk's upper triangle only to drop it, and read the [L, P + L] mask in every layer (a
    512-token chunk after 512 cached: 11.5 ms a layer against 9.9 on a 2-core EPYC)."""
    o_prefix, lse_prefix = _FLASH_CPU(q, k_prefix, v_prefix, 0.0, False, scale=scale)
    o_new, lse_new = _FLASH_CPU(q, k_new, v_new, 0.0, True, scale=scale)
    # the prefix's share of each query's softmax mass: e^a / (e^a + e^b) = sigmoid(a - b)
    w = torch.sigmoid(lse_prefix - lse_new)[..., None]
    return torch.lerp(o_new, o_prefix, w)
