"""Attention through the Triton kernels (CUDA, or `kernels = "triton"` anywhere).

The context is read through block tables, never gathered. A step's metadata is every
decode row's block table and length after the step (a speculating sequence's check rows each
one longer than the last), or on a step with prompt tokens every sequence's, in batch order,
and the new tokens' offsets (`cu_seqlens_q`). New K/V go to the cache in one
`kernels.store_kv` launch for both, in the model's dtype (the cache's on this path). A
decode-only step is then one decode kernel call (CUDA-graph safe); any other step is one
varlen prefill call over every sequence, decode rows included as one-token chunks.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from helexa import kernels
from helexa.engine.attention.base import AttentionBackend, block_tables

if TYPE_CHECKING:
    from helexa.engine.attention.base import ToDevice
    from helexa.engine.layers.attention import AttentionContext, PagedAttention
    from helexa.engine.scheduler import ScheduledBatch
    from helexa.engine.sequence import Sequence
    from helexa.engine.step_plan import StepPlan


class TritonAttention(AttentionBackend):
    name = "triton"
    captures_graphs = True  # the decode kernel reads lengths and tables from the device

    def plan(
        self,
        plan: StepPlan,
        batch: ScheduledBatch,
        prefill_seqs: list[Sequence],
        decode_seqs: list[Sequence],
        decode_lens: list[int],
    ) -> None:
        if not prefill_seqs:  # a row per token: a draft's check rows are decode rows too
            plan.context_lens = decode_lens
            width = -(-max(decode_lens) // self.block_size)
            plan.block_tables = block_tables(decode_seqs, width)
            return
        news = batch.num_new_tokens
        lengths = [s.num_computed_tokens + n for s, n in zip(batch.seqs, news, strict=True)]
        plan.context_lens = lengths
        width = max(-(-n // self.block_size) for n in lengths)
        plan.block_tables = block_tables(batch.seqs, width)
        plan.cu_seqlens_q = list(accumulate(news, initial=0))
        plan.max_seqlen_q = max(news)

    def build(self, plan: StepPlan, ctx: AttentionContext, tensor: ToDevice) -> None:
        ctx.context_lens = tensor(plan.context_lens, torch.int32)
        ctx.block_tables = tensor(plan.block_tables, torch.int32)
        if plan.cu_seqlens_q is not None:
            ctx.cu_seqlens_q = tensor(plan.cu_seqlens_q, torch.int32)
            ctx.max_seqlen_q = plan.max_seqlen_q

    def store(
        self, attn: PagedAttention, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernels.store_kv(k, v, attn.k_cache, attn.v_cache, ctx.slot_mapping)
        return k, v

    def forward(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.cu_seqlens_q is None:  # a decode-only step
            return kernels.paged_decode_attention(
                q, attn.k_cache, attn.v_cache, ctx.block_tables, ctx.context_lens, attn.scale
            )
        return kernels.paged_prefill_attention(
            q, attn.k_cache, attn.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
            ctx.block_tables, attn.scale, ctx.max_seqlen_q,
        )  # fmt: skip
