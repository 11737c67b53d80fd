"""One step's inputs as host values: what rank 0 plans and every rank builds tensors from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.engine.state_manager import StateCopy


@dataclass(slots=True)
class StepPlan:
    """One step's inputs as host values, no Sequence and no tensor: rank 0 plans the step
    from the scheduled batch and, under tensor parallel, sends the plan to every other rank,
    so that all of them build the same tensors from it (`ModelRunner.build`)."""

    ids: list[int]  # [num_tokens] the flat batch's token ids
    positions: list[int]  # [num_tokens]
    slots: list[int]  # [num_tokens] the cache slot of each new token
    # one per prefill chunk: start row, end row, state slot, tokens cached before it
    prefills: list[tuple[int, int, int, int]]
    decode_rows: list[int]  # rows of one-token chunks that continue a sequence
    sample_rows: list[int]  # rows whose logits are computed this step
    sample_seqs: list[int]  # their sequences' batch indices
    restores: list[StateCopy]  # state copies before the forward
    snapshots: list[StateCopy]  # and after it
    has_prompt: bool  # PREFILL_STEP: some sequence is still reading its prompt
    # ROWS_ALONE: some sequence checks a draft, so every row computes as one row would
    checks: bool = False
    decode_state_slots: list[int] | None = None  # hybrid models: the decode rows' state rows
    # the model returns the sample rows' hidden states only (AttentionContext.output_rows):
    # a prompt step's last layer then runs its MLP on those rows alone
    output_rows: bool = False
    # images: M-RoPE's [t, h, w] positions of every row (None: `positions` on all three),
    # and the rows whose embeddings are the vision tower's output `splice` (the one tensor
    # of a plan: on rank 0's device, on the CPU as it travels to the other ranks)
    mrope: list[list[int]] | None = None
    splice_rows: list[int] | None = None
    splice: torch.Tensor | None = None
    # the attention backend's own (helexa/engine/attention), which only it fills and reads.
    # SDPA and native: each prefill's whole context by slot where it has a cached prefix
    # (else None), the decode rows' context lengths and padded block tables
    prefill_contexts: list[list[int] | None] | None = None
    decode_lens: list[int] | None = None
    decode_tables: list[list[int]] | None = None
    # Triton: every sequence's length after the step and padded block table; with
    # prefills, the new tokens' offsets and the longest chunk
    context_lens: list[int] | None = None
    block_tables: list[list[int]] | None = None
    cu_seqlens_q: list[int] | None = None
    max_seqlen_q: int = 1
