"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at load.

A decode step launches hundreds of small kernels; replaying a captured graph launches them
all at once. Each graph reads its inputs from static buffers (token ids, positions, cache
slots, context lengths, block tables, recurrent-state rows) that a step fills with one
non-blocking copy each, padded up to the bucket: padding rows write their K/V to a scratch
block and their recurrent state to a scratch row that no sequence owns, and attend to
nothing (context length 0). Only the model's forward is captured; logits and sampling run
after it, on the rows that are real. A speculative step's check rows are decode rows too
(each attends over its sequence's context up to itself), so it replays the graph of its
row count like any decode step.

Graphs need an attention backend that `captures_graphs`: Triton's, whose decode kernel reads
lengths and block tables from the device (SDPA's shapes change with the context).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from helexa.engine.layers.attention import AttentionContext

if TYPE_CHECKING:
    from helexa.engine.attention import AttentionBackend
    from helexa.engine.scheduler import ScheduledBatch
    from helexa.engine.sequence import Sequence

log = logging.getLogger(__name__)
MAX_GRAPH_BATCH = 512


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to the maximum."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {b for b in (1, 2, 4, 8) if b <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


class ModelRunner(Protocol):
    """What graphs need of model_runner.ModelRunner (which imports this module)."""

    model: nn.Module
    device: torch.device
    block_size: int
    scratch_block: int
    scratch_state_slot: int
    attention: AttentionBackend
    recurrent_layers: list

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]: ...

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]: ...

    def block_tables(self, seqs: list[Sequence], width: int) -> list[list[int]]: ...


class DecodeGraphs:
    """The captured graphs of one model runner and the static buffers they read."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        dev, n = runner.device, self.max_batch
        self.width = -(-max_model_len // runner.block_size)  # block-table columns
        self.scratch_slot = runner.scratch_block * runner.block_size
        self.scratch_state = runner.scratch_state_slot
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.state_slots = torch.full((n,), self.scratch_state, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, runner: ModelRunner, bs: int) -> torch.Tensor:
        positions = self.positions[:bs]
        cos, sin = runner.rotary_tables(positions)
        ctx = AttentionContext(
            slot_mapping=self.slot_mapping[:bs],
            cos=cos,
            sin=sin,
            prefills=[],
            decode_rows=self.rows[:bs],
            all_decode=True,
            decode_state_slots=self.state_slots[:bs] if runner.recurrent_layers else None,
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
        )
        return runner.model(self.input_ids[:bs], positions, ctx)

    @torch.inference_mode()
    def capture(self, runner: ModelRunner) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        pool = None
        for bs in reversed(self.buckets):
            self._forward(runner, bs)  # compiles and autotunes outside the capture
            torch.cuda.synchronize(runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = self._forward(runner, bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(runner.device)

    def fits(self, batch: ScheduledBatch, checks: bool = True) -> bool:
        """Whether the step is decode only: one new token per sequence, or a speculating
        sequence's last token and draft (`checks`: the runner checks drafts as decode rows),
        every sequence sampling, in all no more rows than the largest graph."""
        n = len(batch.seqs)
        return (
            batch.num_tokens <= self.max_batch
            and all(
                k == 1 + len(s.draft) and (checks or not s.draft)
                for s, k in zip(batch.seqs, batch.num_new_tokens, strict=True)
            )
            and all(s.num_computed_tokens > 0 for s in batch.seqs)
            and all(batch.samples(i) for i in range(n))
        )

    @staticmethod
    def host_rows(runner: ModelRunner, batch: ScheduledBatch) -> tuple[list[list[int]], list]:
        """A decode step's rows as host lists: ids, positions, slots, context lengths and
        state rows, one entry a row, and the rows' sequences (a speculating sequence's
        check rows after one another, each a token longer: they replay as decode rows
        of one graph, so a check step has a fixed shape too)."""
        ids, positions, slots, lengths, states, seqs = [], [], [], [], [], []
        for seq in batch.seqs:
            p = seq.num_computed_tokens
            tokens = [seq.token_ids[p], *seq.draft]
            ids.extend(tokens)
            off = seq.position_offset  # past a prompt's images: M-RoPE
            positions.extend(range(p + off, p + len(tokens) + off))
            slots.extend(runner.slots(seq, p, p + len(tokens)))
            lengths.extend(range(p + 1, p + len(tokens) + 1))
            states.extend([seq.state_slot] * len(tokens))
            seqs.extend([seq] * len(tokens))
        return [ids, positions, slots, lengths, states], seqs

    def run(
        self, runner: ModelRunner, batch: ScheduledBatch, checks: bool = True
    ) -> torch.Tensor | None:
        """Replay the bucket's graph for a decode step: hidden [rows, hidden_size], a row per
        sequence and check row in order, or None when the step is not one a graph covers
        (the runner then runs it eagerly)."""
        if not self.fits(batch, checks):
            return None
        (ids, positions, slots, lengths, states), seqs = self.host_rows(runner, batch)
        n = len(ids)
        bs = next(b for b in self.buckets if b >= n)
        pad = bs - n
        cols = -(-max(lengths) // runner.block_size)
        tables = runner.block_tables(seqs, cols)
        host = torch.tensor(
            [
                ids + [0] * pad,
                positions + [0] * pad,
                slots + [self.scratch_slot] * pad,
                lengths + [0] * pad,
                [s if s >= 0 else self.scratch_state for s in states] + [self.scratch_state] * pad,
            ],
            dtype=torch.long,
            pin_memory=True,
        )
        packed = host.to(runner.device, non_blocking=True)
        self.input_ids[:bs].copy_(packed[0])
        if runner.id_limit is not None:  # a narrower draft model's (ModelRunner.id_limit)
            self.input_ids[:bs].clamp_(max=runner.id_limit - 1)
        self.positions[:bs].copy_(packed[1])
        self.slot_mapping[:bs].copy_(packed[2])
        self.context_lens[:bs].copy_(packed[3])
        self.state_slots[:bs].copy_(packed[4])
        table = torch.tensor(tables, dtype=torch.int32, pin_memory=True)
        self.block_tables[:n, :cols].copy_(table, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def capture_decode_graphs(
    runner: ModelRunner, max_num_seqs: int, max_model_len: int
) -> tuple[DecodeGraphs | None, str | None]:
    """Graphs for `runner` on a CUDA device, or None and the reason they cannot be used."""
    if not runner.attention.captures_graphs:
        name = runner.attention.name
        return None, f"CUDA graphs need the Triton kernels (attention runs {name!r})"
    graphs = DecodeGraphs(runner, max_num_seqs, max_model_len)
    try:
        graphs.capture(runner)
    except Exception as e:  # a layer that syncs (e.g. quantized experts by expert)
        torch.cuda.synchronize(runner.device)
        reason = f"capture failed: {type(e).__name__}: {e}"
        log.warning("CUDA graphs off for this model, decode runs eagerly (%s)", reason)
        return None, reason
    log.info("captured CUDA graphs for decode batches %s", graphs.buckets)
    return graphs, None
