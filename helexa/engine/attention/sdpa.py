"""Attention in plain torch: SDPA over gathered context (the reference, and the CPU's path).

Each layer writes its new K/V with `index_copy_`, cast to the cache's dtype: on the CPU a
float16 cache under a float32 model (`[engine] kv_cache_dtype`), whose values the new tokens
then attend over too, as every later step will, so that a prompt gives the same logits
computed whole, in chunks or after a cached prefix.

- A prompt chunk that is its sequence's whole context attends to its own K/V, causally.
  A later chunk gathers its context by slot (`context_slots`): on the CPU the cached prefix
  and the chunk attend apart and merge (`prefix_then_causal`), elsewhere through one
  [chunk, context] mask built with the step.
- Decode rows gather whole blocks (`decode_blocks`: a few long copies rather than one short
  copy per token) and run one batched SDPA, masked where a row ends short of its blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from helexa.engine.attention.base import AttentionBackend, block_tables, slots

if TYPE_CHECKING:
    from helexa.engine.attention.base import ToDevice
    from helexa.engine.layers.attention import AttentionContext, PagedAttention, PrefillSegment
    from helexa.engine.scheduler import ScheduledBatch
    from helexa.engine.sequence import Sequence
    from helexa.engine.step_plan import StepPlan


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def plan(
        self,
        plan: StepPlan,
        batch: ScheduledBatch,
        prefill_seqs: list[Sequence],
        decode_seqs: list[Sequence],
        decode_lens: list[int],
    ) -> None:
        # a later chunk's whole context (cached prefix + chunk), by slot
        plan.prefill_contexts = [
            slots(seq, 0, cached + end - start, self.block_size) if cached else None
            for seq, (start, end, _, cached) in zip(prefill_seqs, plan.prefills, strict=True)
        ]
        if decode_seqs:  # the decode rows' whole blocks and lengths
            plan.decode_lens = decode_lens
            width = -(-max(decode_lens) // self.block_size)
            plan.decode_tables = block_tables(decode_seqs, width)

    def build(self, plan: StepPlan, ctx: AttentionContext, tensor: ToDevice) -> None:
        split = split_prefix_attention(self.device)
        for seg, context in zip(ctx.prefills, plan.prefill_contexts, strict=True):
            if context is None:
                continue
            seg.context_slots = tensor(context)
            if not split:  # query i sees keys up to span - length + i
                n, span = seg.end - seg.start, len(context)
                mask = torch.ones(n, span, dtype=torch.bool).tril(span - n)
                seg.mask = mask.to(self.device, non_blocking=True)
        if plan.decode_tables is None:
            return
        ctx.decode_blocks = tensor(plan.decode_tables)
        ctx.decode_lens = tensor(plan.decode_lens, torch.int32)
        span = len(plan.decode_tables[0]) * self.block_size
        ctx.decode_ragged = any(n != span for n in plan.decode_lens)
        if ctx.decode_ragged:  # some row ends short of its last block
            ctx.decode_mask = self.decode_mask(ctx.decode_lens, span)

    def decode_mask(self, lens: torch.Tensor, span: int) -> torch.Tensor | None:
        """The decode rows' mask for SDPA (see `decode_mask`)."""
        return decode_mask(lens, span, self.dtype)

    def store(
        self, attn: PagedAttention, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, d = attn.num_kv_heads, attn.head_dim
        k, v = k.to(attn.k_cache.dtype), v.to(attn.v_cache.dtype)  # no-ops where they agree
        attn.k_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, k)
        attn.v_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, v)
        return k, v

    def forward(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.all_decode:
            return self.decode(attn, q, ctx)
        out = q.new_empty(q.shape)
        k, v = k.to(q.dtype), v.to(q.dtype)  # the cache's values, in the queries' dtype
        for seg in ctx.prefills:
            out[seg.start : seg.end] = self.prefill(attn, q, k, v, seg)
        if ctx.decode_rows is not None:
            out[ctx.decode_rows] = self.decode(attn, q[ctx.decode_rows], ctx)
        return out

    def prefill(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        """One chunk's rows of q, k, v [num_tokens, *, D] -> its output [L, H, D]."""
        # 4-D, with a batch of one: torch's CPU flash kernel takes only 4-D inputs, and
        # 3-D ones fell to the math path (a masked 512-token chunk after 512 cached:
        # 28 ms a layer against 10 on the 2-core VM). K/V keep their kv heads: the
        # kernel reads each for its `group` query heads (enable_gqa), no repeat copied.
        rows = slice(seg.start, seg.end)
        qs = q[rows].transpose(0, 1)[None]  # [1, H, L, D]
        ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]  # [1, KVH, L, D]
        scale = attn.scale
        if seg.context_slots is None:  # the chunk is the whole context
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        elif seg.mask is None:  # a later chunk on the CPU: the cached prefix, then itself
            kp, vp = self._gather(attn, seg.context_slots[: seg.cached], q.dtype)
            o = prefix_then_causal(qs, kp, vp, ks, vs, scale)
        else:
            ks, vs = self._gather(attn, seg.context_slots, q.dtype)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=seg.mask, scale=scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)

    @staticmethod
    def _gather(attn: PagedAttention, where: torch.Tensor, dtype: torch.dtype):
        """K, V [1, KVH, len(where), D] of the cache's slots `where`, in `dtype`."""
        kvh, d = attn.num_kv_heads, attn.head_dim
        k = attn.k_cache.view(-1, kvh, d)[where].to(dtype).transpose(0, 1)[None]
        v = attn.v_cache.view(-1, kvh, d)[where].to(dtype).transpose(0, 1)[None]
        return k, v

    def decode(self, attn: PagedAttention, q: torch.Tensor, ctx: AttentionContext):
        """The decode rows' queries q [n, H, D] over their whole blocks -> [n, H, D]."""
        # Grouped-query trick: the `group` query heads sharing a kv head become the
        # query-length axis of that kv head, so no K/V repeat is needed.
        n, kvh, d = q.shape[0], attn.num_kv_heads, attn.head_dim
        qd = q.view(n, kvh, -1, d)
        kd = attn.k_cache[ctx.decode_blocks].to(q.dtype).view(n, -1, kvh, d).transpose(1, 2)
        vd = attn.v_cache[ctx.decode_blocks].to(q.dtype).view(n, -1, kvh, d).transpose(1, 2)
        # kd, vd: [n, kvh, max_blocks * block_size, d]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ctx.decode_mask, scale=attn.scale)
        return o.reshape(n, attn.num_heads, d)


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
    than through a [chunk, context] mask (which the step then need not build)."""
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
