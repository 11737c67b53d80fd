"""What every attention backend is: the few methods the model runner and PagedAttention call.

A backend is one execution path of `PagedAttention`, chosen once by the model runner
(`attention.select_backend`) and shared by every layer: the step metadata it alone needs,
planned on the host (`plan`, into the StepPlan that tensor-parallel ranks share) and put on
the device (`build`, into the AttentionContext); how a layer's new K/V reach its cache
(`store`); and the attention over the cache (`forward`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from helexa.engine.layers.attention import AttentionContext, PagedAttention
    from helexa.engine.scheduler import ScheduledBatch
    from helexa.engine.sequence import Sequence
    from helexa.engine.step_plan import StepPlan

    ToDevice = Callable[..., torch.Tensor]  # ModelRunner.tensor: a host list on the device


class AttentionBackend:
    """One way to run PagedAttention on the runner's device and dtype."""

    name = "base"
    captures_graphs = False  # whether a decode step can be replayed from a CUDA graph

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.device = device
        self.dtype = dtype  # the model's: what q, k and v come in
        self.block_size = block_size

    def plan(
        self,
        plan: StepPlan,
        batch: ScheduledBatch,
        prefill_seqs: list[Sequence],
        decode_seqs: list[Sequence],
        decode_lens: list[int],
    ) -> None:
        """Fill the plan's host metadata for this backend (prefill_seqs: one per
        plan.prefills entry; decode_seqs and decode_lens, each row's sequence and context
        length after the step: one per plan.decode_rows entry. A speculating sequence has a
        decode row per token it checks, each one longer than the last.)"""

    def build(self, plan: StepPlan, ctx: AttentionContext, tensor: ToDevice) -> None:
        """Fill the context's device metadata for this backend from the plan."""

    def store(
        self, attn: PagedAttention, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k, v [num_tokens, KVH, D] to their slots; return them as the
        cache holds them (what forward attends over)."""
        raise NotImplementedError

    def forward(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Each new token's attention over its sequence's context: q [num_tokens, H, D] ->
        [num_tokens, H, D]."""
        raise NotImplementedError


def slots(seq: Sequence, start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of `seq`."""
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def block_tables(seqs: list[Sequence], width: int) -> list[list[int]]:
    """Each sequence's first `width` blocks, padded with block 0 (read by no one)."""
    return [t + [0] * (width - len(t)) for t in (s.block_table[:width] for s in seqs)]
