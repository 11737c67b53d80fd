"""Runs one scheduled batch through the model: inputs → forward → logits → tokens.

The runner owns the KV cache tensors and the model; it never decides who runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from helexa import kernels
from helexa.engine.cuda_graph import DecodeGraphs, capture_decode_graphs
from helexa.engine.layers import sampler as sampling_ops
from helexa.engine.layers.attention import (
    AttentionContext,
    PrefillSegment,
    split_prefix_attention,
)
from helexa.engine.layers.linear import PREFILL_STEP
from helexa.engine.layers.sampler import Sampler
from helexa.engine.scheduler import ScheduledBatch
from helexa.engine.sequence import Sequence, TokenLogprob
from helexa.engine.state_manager import StateCopy
from helexa.kernels import QuantWeight

MiB = 1 << 20


def recurrent_layers(model: torch.nn.Module) -> list:
    """The model's layers that keep a recurrent state per sequence (hybrid models)."""
    return list(getattr(model, "recurrent_layers", ()))


class NonFiniteLogitsError(RuntimeError):
    """Every row of a step's logits was NaN/Inf: a sign of a device fault or bad weights."""


class NonFiniteRowError(RuntimeError):
    """One sequence's logits were NaN/Inf while its batch-mates' were finite: it fails alone."""


@dataclass(slots=True)
class StepPlan:
    """One step's inputs as host values, no Sequence and no tensor: rank 0 plans the step
    from the scheduled batch and, under tensor parallel, sends the plan to every other rank,
    so that all of them build the same tensors from it (`ModelRunner.build`)."""

    ids: list[int]  # [num_tokens] the flat batch's token ids
    positions: list[int]  # [num_tokens]
    slots: list[int]  # [num_tokens] the cache slot of each new token
    # one per prefill chunk: start row, end row, state slot, tokens cached before it, and on
    # the torch path for a later chunk the slots of its whole context (else None)
    prefills: list[tuple[int, int, int, int, list[int] | None]]
    decode_rows: list[int]  # rows of one-token chunks that continue a sequence
    sample_rows: list[int]  # rows whose logits are computed this step
    sample_seqs: list[int]  # their sequences' batch indices
    restores: list[StateCopy]  # state copies before the forward
    snapshots: list[StateCopy]  # and after it
    has_prompt: bool  # PREFILL_STEP: some sequence is still reading its prompt
    decode_state_slots: list[int] | None = None  # hybrid models: the decode rows' state rows
    decode_lens: list[int] | None = None  # torch path: each decode row's context length
    decode_tables: list[list[int]] | None = None  # torch path: their padded block tables
    context_lens: list[int] | None = None  # Triton path: every sequence's length after the step
    block_tables: list[list[int]] | None = None  # Triton path: every sequence's, padded
    cu_seqlens_q: list[int] | None = None  # Triton path, with prefills: new-token offsets
    max_seqlen_q: int = 1
    # the model returns the sample rows' hidden states only (AttentionContext.output_rows):
    # a prompt step's last layer then runs its MLP on those rows alone
    output_rows: bool = False


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV cache's (engine_args.kv_dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler()
        # the whole model's kernels are Triton (CUDA, or `kernels = "triton"`) or plain torch
        self.use_triton = kernels.uses_triton(torch.empty(0, device=device))
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs()
        self.attention_layers = model.attention_layers
        self.recurrent_layers = recurrent_layers(model)
        # One block and one state row past what the managers hand out: where the padding
        # rows of a CUDA-graph batch write, so that they never touch a sequence's.
        self.scratch_block = num_blocks
        self.scratch_state_slot = num_state_slots
        for attn in self.attention_layers:
            shape = (num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        rows = num_state_slots + 1
        for layer in self.recurrent_layers:
            conv, ssm = layer.state_shapes()
            layer.conv_state = torch.zeros(rows, *conv, dtype=dtype, device=device)
            # the delta-rule state accumulates over the whole context: kept in float32
            layer.ssm_state = torch.zeros(rows, *ssm, dtype=torch.float32, device=device)
        # the model honours AttentionContext.output_rows (the scripted test model does not)
        self.selects_output_rows = getattr(model, "selects_output_rows", False)
        self.graphs_off_reason: str | None = "not captured"
        # tensor parallel, on rank 0: sends each step's plan to the other ranks
        self.broadcast: Callable[[StepPlan], None] | None = None

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode CUDA graphs on a CUDA device (or record why not, in
        graphs_off_reason)."""
        self.graphs, self.graphs_off_reason = capture_decode_graphs(
            self, max_num_seqs, max_model_len
        )

    @staticmethod
    def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * elem for a in model.attention_layers)

    @staticmethod
    def state_bytes_per_slot(model: torch.nn.Module, dtype: torch.dtype) -> int:
        """Bytes of recurrent state one sequence holds (0 for attention-only models)."""
        elem = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in recurrent_layers(model):
            conv, ssm = layer.state_shapes()
            total += math.prod(conv) * elem + math.prod(ssm) * 4
        return total

    def copy_states(self, copies: list[StateCopy]) -> None:
        """Copy state rows (and KV blocks) as the scheduler asked: snapshots in and out."""
        if not copies:
            return
        src = self.tensor([c.src_slot for c in copies])
        dst = self.tensor([c.dst_slot for c in copies])
        for layer in self.recurrent_layers:
            layer.conv_state.index_copy_(0, dst, layer.conv_state[src])
            layer.ssm_state.index_copy_(0, dst, layer.ssm_state[src])
        blocks = [(c.src_block, c.dst_block) for c in copies if c.src_block is not None]
        if blocks:
            bsrc = self.tensor([b[0] for b in blocks])
            bdst = self.tensor([b[1] for b in blocks])
            for attn in self.attention_layers:
                attn.k_cache.index_copy_(0, bdst, attn.k_cache[bsrc])
                attn.v_cache.index_copy_(0, bdst, attn.v_cache[bsrc])

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end) of `seq`."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @staticmethod
    def block_tables(seqs: list[Sequence], width: int) -> list[list[int]]:
        """Each sequence's first `width` blocks, padded with block 0 (read by no one)."""
        return [t + [0] * (width - len(t)) for t in (s.block_table[:width] for s in seqs)]

    def tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list on the device. On CUDA through pinned memory and a non-blocking copy:
        `torch.tensor(values, device=cuda)` would wait for the stream (a host sync)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The step's inputs as host values (see StepPlan)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[tuple[int, int, int, int, list[int] | None]] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        triton = self.use_triton
        row = 0
        for i, seq in enumerate(batch.seqs):
            n = batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.slots(seq, start, start + n))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_seqs.append(seq)
            else:
                context = self.slots(seq, 0, start + n) if start and not triton else None
                prefills.append((row, row + n, seq.state_slot, start, context))
            row += n
            if batch.samples(i):
                sample_rows.append(row - 1)
                sample_seqs.append(i)
        plan = StepPlan(
            ids,
            positions,
            slots,
            prefills,
            decode_rows,
            sample_rows,
            sample_seqs,
            batch.restores,
            batch.snapshots,
            has_prompt=any(s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs),
        )
        plan.output_rows = self.selects_output_rows and len(sample_rows) < len(ids)
        bs = self.block_size
        if triton:  # block tables and lengths of every sequence, for the kernels
            news = batch.num_new_tokens
            lengths = [s.num_computed_tokens + n for s, n in zip(batch.seqs, news, strict=True)]
            plan.context_lens = lengths
            plan.block_tables = self.block_tables(batch.seqs, max(-(-n // bs) for n in lengths))
            if prefills:
                cu = [0]
                for n in news:
                    cu.append(cu[-1] + n)
                plan.cu_seqlens_q = cu
                plan.max_seqlen_q = max(news)
        if decode_seqs:
            if self.recurrent_layers:
                plan.decode_state_slots = [s.state_slot for s in decode_seqs]
            if not triton:  # the torch path gathers whole blocks of each decode row
                lengths = [s.num_computed_tokens + 1 for s in decode_seqs]
                plan.decode_lens = lengths
                plan.decode_tables = self.block_tables(decode_seqs, -(-max(lengths) // bs))
        return plan

    def build(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """The step's device inputs from its plan: token ids, positions, attention context."""
        input_ids = self.tensor(plan.ids)
        pos = self.tensor(plan.positions)
        cos, sin = self.rotary_tables(pos)
        prefills: list[PrefillSegment] = []
        for start, end, state_slot, cached, context in plan.prefills:
            seg = PrefillSegment(start, end, None, state_slot=state_slot, cached=cached)
            if context is not None:  # a later chunk on the torch path
                seg.context_slots = self.tensor(context)
                if not split_prefix_attention(self.device):  # else no mask is needed
                    n, span = end - start, len(context)
                    seg.mask = torch.ones(n, span, dtype=torch.bool).tril(span - n)
                    seg.mask = seg.mask.to(self.device, non_blocking=True)
            prefills.append(seg)
        ctx = AttentionContext(
            slot_mapping=self.tensor(plan.slots),
            cos=cos,
            sin=sin,
            prefills=prefills,
            decode_rows=None,
            decode_blocks=None,
            decode_mask=None,
        )
        if plan.output_rows:
            ctx.output_rows = self.tensor(plan.sample_rows)
        if plan.context_lens is not None:
            ctx.context_lens = self.tensor(plan.context_lens, torch.int32)
            ctx.block_tables = self.tensor(plan.block_tables, torch.int32)
            if plan.cu_seqlens_q is not None:
                ctx.cu_seqlens_q = self.tensor(plan.cu_seqlens_q, torch.int32)
                ctx.max_seqlen_q = plan.max_seqlen_q
        if plan.decode_rows:
            ctx.decode_rows = self.tensor(plan.decode_rows)
            ctx.all_decode = not prefills
            if plan.decode_state_slots is not None:
                ctx.decode_state_slots = self.tensor(plan.decode_state_slots)
            if plan.decode_tables is not None:
                self._decode_blocks(ctx, plan.decode_tables, plan.decode_lens)
        return input_ids, pos, ctx

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """cos, sin [num_tokens, 1, rotary_dim] for the positions (None without rotary)."""
        rotary = getattr(self.model, "rotary", None)
        return rotary.lookup(positions, self.dtype) if rotary is not None else (None, None)

    def _decode_blocks(
        self, ctx: AttentionContext, tables: list[list[int]], lengths: list[int]
    ) -> None:
        """Torch path: the decode rows' whole blocks and lengths; whether some row ends short
        of its last block, for which attention then masks (`decode_mask`, built by the
        first layer that needs it: the native decode kernels read the lengths instead)."""
        ctx.decode_blocks = self.tensor(tables)
        ctx.decode_lens = self.tensor(lengths, torch.int32)
        span = len(tables[0]) * self.block_size
        ctx.decode_ragged = any(n != span for n in lengths)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The model over the plan's inputs: hidden [num_tokens, hidden_size]."""
        input_ids, positions, ctx = self.build(plan)
        with _prompt_step(plan.has_prompt):
            return self.model(input_ids, positions, ctx)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A follower rank's step: rank 0's copies, forward and logits (whose collectives
        it takes part in), without sampling."""
        self.copy_states(plan.restores)
        hidden = self.forward(plan)
        self.copy_states(plan.snapshots)
        if plan.sample_rows:
            # seqs are only read by the scripted test model, never sharded
            rows = hidden if plan.output_rows else hidden[plan.sample_rows]
            with _prompt_step(plan.has_prompt):  # as rank 0 computes them
                self.model.compute_logits(rows, None)

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None, dict[int, Exception]]:
        """Forward the batch; sample one token for each sequence that reached its end.

        Returns tokens and logprobs by batch index, and the sequences that failed alone
        (non-finite logits in their row only, or their sampling raised) with the error.
        A failure of the forward pass, or non-finite logits in every row, raises.

        A decode step on CUDA reads nothing back from the device but its sampled tokens
        (with each row's finiteness, in the same copy)."""
        self.copy_states(batch.restores)
        hidden = self.graphs.run(self, batch) if self.graphs is not None else None
        if hidden is None:
            plan = self.plan(batch)
            if self.broadcast is not None:  # tensor parallel: the followers run it too
                self.broadcast(plan)
            hidden = self.forward(plan)
            sample_rows, sample_seqs = plan.sample_rows, plan.sample_seqs
            prompt_step = plan.has_prompt
            if plan.output_rows:  # the model returned those rows alone, in order
                sample_rows = sample_seqs
        else:  # a replayed graph: every sequence decodes and samples, in order
            sample_seqs = list(range(len(batch.seqs)))
            sample_rows = sample_seqs
            prompt_step = False
        self.copy_states(batch.snapshots)
        out: list[int | None] = [None] * len(batch.seqs)
        errors: dict[int, Exception] = {}
        if not sample_seqs:
            return out, None, errors
        sampling = [batch.seqs[i] for i in sample_seqs]
        rows = hidden[: len(sample_rows)] if sample_rows is sample_seqs else hidden[sample_rows]
        # a prompt step's logits in float32 too (PREFILL_STEP): its first token is the
        # answer's first word, and SmolLM2's "What is the capital of France?" has "The" and
        # "L" within 0.08 of each other there, which the decode kernels' rounding swapped
        with _prompt_step(prompt_step):
            logits = self.model.compute_logits(rows, sampling)
        if any(s.params.debug_fault == "nonfinite" for s in sampling):
            for j, s in enumerate(sampling):
                if s.params.debug_fault == "nonfinite":
                    logits[j] = torch.nan
        finite_rows = sampling_ops.finite_rows(logits)
        # seeded rows' generators as they were, for a retry row by row after a failed attempt
        states = [q.generator.get_state() if q.generator is not None else None for q in sampling]
        wants_logprobs = any(q.params.logprobs is not None for q in sampling)
        tokens = None if wants_logprobs else self._sample_fast(logits, sampling, finite_rows)
        finite = tokens[1] if tokens is not None else finite_rows.tolist()
        if not any(finite):  # a lone sequence, or all of them: the device, not a request
            bad = [s.request_id for s in sampling]
            raise NonFiniteLogitsError(f"non-finite logits for requests {bad}")
        if not all(finite):
            for j, ok in enumerate(finite):
                if not ok:
                    errors[sample_seqs[j]] = NonFiniteRowError(
                        f"non-finite logits for request {sampling[j].request_id} "
                        "while its batch-mates' were finite"
                    )
        if tokens is not None:  # rows sample independently: the finite rows' tokens stand
            for j, i in enumerate(sample_seqs):
                if finite[j]:
                    out[i] = tokens[0][j]
            return out, None, errors
        if not all(finite):
            keep = [j for j, ok in enumerate(finite) if ok]
            logits = logits[keep]
            sampling = [sampling[j] for j in keep]
            sample_seqs = [sample_seqs[j] for j in keep]
            states = [states[j] for j in keep]
        # the whole batch at once, unless the fast path just failed at that
        tokens, lps, failed = self._sample(logits, sampling, states, whole_batch=wants_logprobs)
        out_lps: list[TokenLogprob | None] = [None] * len(batch.seqs)
        for j, i in enumerate(sample_seqs):
            if failed[j] is not None:
                errors[i] = failed[j]
                continue
            out[i] = tokens[j]
            if lps is not None:
                out_lps[i] = lps[j]
        return out, (out_lps if lps is not None else None), errors

    def _sample_fast(
        self, logits: torch.Tensor, seqs: list[Sequence], finite: torch.Tensor
    ) -> tuple[list[int], list[bool]] | None:
        """Tokens and row finiteness in one device-to-host copy, when sampling the whole batch
        at once succeeds; else None (the careful path runs, row by row)."""
        try:
            tokens = self.sampler.sample(logits, seqs)
            host = torch.stack((tokens, finite.to(tokens.dtype))).tolist()
        except Exception:
            return None
        return host[0], [bool(f) for f in host[1]]

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        states: list[torch.Tensor | None],
        *,
        whole_batch: bool,
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None, list[Exception | None]]:
        """The sampler over the batch (when `whole_batch`); when that raises, or was already
        tried, row by row, so that one sequence's error fails it alone and the others get the
        tokens they would have got (seeded rows from their generators' `states` before any
        attempt)."""
        # logits: [num_seqs, vocab]
        num = len(seqs)
        if whole_batch:
            try:
                tokens, lps = self.sampler(logits, seqs)
                return tokens, lps, [None] * num
            except Exception:
                pass  # found again below, row by row
        out: list[int | None] = [None] * num
        out_lps: list[TokenLogprob | None] = [None] * num
        errors: list[Exception | None] = [None] * num
        for j, (seq, state) in enumerate(zip(seqs, states, strict=True)):
            if seq.generator is not None and state is not None:
                seq.generator.set_state(state)
            try:
                row_tokens, row_lps = self.sampler(logits[j : j + 1], [seq])
            except Exception as e:
                errors[j] = e
                continue
            out[j] = row_tokens[0]
            if row_lps is not None:
                out_lps[j] = row_lps[0]
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        return out, (out_lps if wants_logprobs else None), errors


def model_memory_mb(model: torch.nn.Module) -> int:
    """Weights (packed, dense copies, quantized on a GPU), KV pool and buffers: every tensor
    the model's modules hold, as parameters or as plain attributes, each storage counted once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        attrs = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for v in vars(module).values():
            if isinstance(v, QuantWeight):
                attrs.extend(v.tensors)
            elif isinstance(v, torch.nn.Module):  # held, not a submodule (a packed table)
                attrs.extend(t for t in vars(v).values() if isinstance(t, torch.Tensor))
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False), *attrs):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) // MiB


@contextlib.contextmanager
def _prompt_step(has_prompt: bool) -> Iterator[None]:
    """PREFILL_STEP for what runs inside: a step that carries prompt tokens computes in
    float32 (layers/linear.py), its forward and its logits alike."""
    token = PREFILL_STEP.set(has_prompt)
    try:
        yield
    finally:
        PREFILL_STEP.reset(token)
