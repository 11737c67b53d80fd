"""Runs one scheduled batch through the model: inputs → forward → logits → tokens.

The runner owns the KV cache tensors and the model; it never decides who runs. It picks,
once, the attention backend every layer runs through (helexa/engine/attention). A step is
`forward_step` (a captured decode graph replayed, or the step planned, built and run
eagerly) then `sample` (the logits, and step_sampler.StepSampler's tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from helexa.engine.attention import AttentionBackend, select_backend
from helexa.engine.attention import base as paging
from helexa.engine.cuda_graph import DecodeGraphs, capture_decode_graphs
from helexa.engine.layers.attention import AttentionContext, PrefillSegment
from helexa.engine.layers.linear import PREFILL_STEP, ROWS_ALONE
from helexa.engine.scheduler import ScheduledBatch
from helexa.engine.sequence import Sequence, TokenLogprob
from helexa.engine.spec.verify import accepted, accepted_sampled
from helexa.engine.state_manager import StateCopy
from helexa.engine.step_plan import StepPlan
from helexa.engine.step_sampler import (  # noqa: F401 (re-exported: the engine, the worker)
    NonFiniteLogitsError,
    NonFiniteRowError,
    StepSampler,
)
from helexa.kernels import QuantWeight


class Drafter(Protocol):
    """What the runner needs of a model drafter (spec/draft_model.py, spec/mtp_drafter.py,
    which import this module): the step's drafts written into its rows' placeholders."""

    def propose(self, batch: ScheduledBatch) -> None: ...


MiB = 1 << 20


def recurrent_layers(model: torch.nn.Module) -> list:
    """The model's layers that keep a recurrent state per sequence (hybrid models)."""
    return list(getattr(model, "recurrent_layers", ()))


@dataclass(slots=True)
class StepHidden:
    """A step's forward, as sampling reads it: hidden states, the rows of them to sample
    (None: the first len(seqs), in order) and those rows' sequences' batch indices."""

    hidden: torch.Tensor
    rows: list[int] | None
    seqs: list[int]
    has_prompt: bool
    checks: bool = False  # StepPlan.checks


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
        self.step_sampler = StepSampler()
        # how every attention layer runs, for the whole model: Triton, native or SDPA
        self.attention: AttentionBackend = select_backend(device, dtype, self.kv_dtype, block_size)
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
            attn.backend = self.attention
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
        # speculative decoding's draft model or MTP head (spec/draft_model.py, mtp_drafter.py):
        # a step's drafts, written before its forward; None for the scheduler's or none
        self.drafter: Drafter | None = None
        # the MTP drafter (spec/mtp_drafter.py) reads every forward's hidden states
        self.hidden_reader: Callable[[ScheduledBatch, StepHidden], None] | None = None
        # token ids at or past this are read as the one before it: a draft model narrower
        # than its target (spec/draft_model.py) reads the target's ids it has no row for
        self.id_limit: int | None = None

    @property
    def use_triton(self) -> bool:
        """Whether the model's kernels are Triton (CUDA, or `kernels = "triton"`)."""
        return self.attention.name == "triton"

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
        return paging.slots(seq, start, end, self.block_size)

    @staticmethod
    def block_tables(seqs: list[Sequence], width: int) -> list[list[int]]:
        """Each sequence's first `width` blocks, padded with block 0 (read by no one)."""
        return paging.block_tables(seqs, width)

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
        prefills: list[tuple[int, int, int, int]] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []  # each decode row's context length after the step
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        prefill_seqs: list[Sequence] = []
        decode_seqs: list[Sequence] = []
        images = any(seq.mm is not None for seq in batch.seqs)
        mrope: list[list[int]] = [[], [], []]
        splice_rows: list[int] = []
        splice: list[torch.Tensor] = []
        row = 0
        for i, seq in enumerate(batch.seqs):
            n = batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            if seq.draft:  # speculative decoding: its last token, then the draft to check
                ids.extend(seq.draft)
            if images:
                self._image_rows(seq, start, n, row, mrope, splice_rows, splice)
                positions.extend(mrope[0][row : row + n])
            else:
                off = seq.position_offset
                positions.extend(range(start + off, start + n + off))
            slots.extend(self.slots(seq, start, start + n))
            if (n == 1 and start > 0) or self.checks_as_decode(seq):
                # a draft's check rows too: row j sees the context up to itself, as the
                # decode step it stands for would (the same kernels, the same floats)
                decode_rows.extend(range(row, row + n))
                decode_seqs.extend([seq] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                prefills.append((row, row + n, seq.state_slot, start))
                prefill_seqs.append(seq)
            row += n
            if batch.samples(i):  # a draft's row: the target's logits at each of its tokens
                width = 1 + len(seq.draft)
                sample_rows.extend(range(row - width, row))
                sample_seqs.extend([i] * width)
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
            checks=any(s.draft for s in batch.seqs),
        )
        plan.output_rows = self.selects_output_rows and len(sample_rows) < len(ids)
        if images:
            plan.mrope = mrope
            if splice_rows:
                plan.splice_rows = splice_rows
                plan.splice = torch.cat(splice)
        if decode_seqs and self.recurrent_layers:
            plan.decode_state_slots = [s.state_slot for s in decode_seqs]
        self.attention.plan(plan, batch, prefill_seqs, decode_seqs, decode_lens)
        return plan

    def checks_as_decode(self, seq: Sequence) -> bool:
        """Whether `seq`'s draft is checked as decode rows, one per token (each attending
        over the context up to itself), rather than as a prompt-like chunk: so that each
        check row computes what a one-token decode step at its position computes, through
        the same kernels, and greedy output does not change with speculation. A model with
        recurrent layers checks a draft as a chunk (the delta rule's state runs through it:
        spec/rollback.py)."""
        return bool(seq.draft) and not self.recurrent_layers

    @staticmethod
    def _image_rows(
        seq: Sequence,
        start: int,
        n: int,
        row: int,
        mrope: list[list[int]],
        splice_rows: list[int],
        splice: list[torch.Tensor],
    ) -> None:
        """A chunk's M-RoPE positions (rows `row`.. of the flat batch) and, where it crosses
        images' pad runs, the rows and slices of the tower's output spliced there."""
        mm = seq.mm
        end = start + n
        prompt_end = min(end, seq.num_prompt_tokens)
        off = seq.position_offset
        for axis in range(3):
            if mm is None:
                mrope[axis].extend(range(start + off, end + off))
                continue
            mrope[axis].extend(mm.positions[axis][start:prompt_end])
            mrope[axis].extend(range(max(start, prompt_end) + off, end + off))
        if mm is None:
            return
        for p in mm.overlapping(start, end):
            lo, hi = max(start, p.run.offset), min(end, p.run.end)
            assert p.embeds is not None, "an image's run reached before the tower encoded it"
            splice_rows.extend(range(row + lo - start, row + hi - start))
            splice.append(p.embeds[lo - p.run.offset : hi - p.run.offset])

    def encode_images(self, batch: ScheduledBatch) -> None:
        """The vision tower over the images the scheduler picked for this step, at once; each
        image's output is held on it until its run is computed."""
        if not batch.encodes:
            return
        model = self.model
        outs = model.visual.encode([p.image for p in batch.encodes], model.vision_profile)
        for p, out in zip(batch.encodes, outs, strict=True):
            p.embeds = out

    def build(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """The step's device inputs from its plan: token ids, positions, attention context."""
        input_ids = self.tensor(plan.ids)
        if self.id_limit is not None:
            input_ids = input_ids.clamp(max=self.id_limit - 1)
        pos = self.tensor(plan.positions)
        if plan.mrope is not None:
            cos, sin = self.model.rotary.lookup_mrope(self.tensor(plan.mrope), self.dtype)
        else:
            cos, sin = self.rotary_tables(pos)
        prefills = [
            PrefillSegment(start, end, None, state_slot=state_slot, cached=cached)
            for start, end, state_slot, cached in plan.prefills
        ]
        ctx = AttentionContext(self.tensor(plan.slots), cos, sin, prefills)
        if plan.output_rows:
            ctx.output_rows = self.tensor(plan.sample_rows)
        if plan.splice is not None:
            ctx.splice_rows = self.tensor(plan.splice_rows)
            ctx.splice = plan.splice.to(self.device)
        if plan.decode_rows:
            ctx.decode_rows = self.tensor(plan.decode_rows)
            ctx.all_decode = not prefills
            if plan.decode_state_slots is not None:
                ctx.decode_state_slots = self.tensor(plan.decode_state_slots)
        self.attention.build(plan, ctx, self.tensor)
        return input_ids, pos, ctx

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """cos, sin [num_tokens, 1, rotary_dim] for the positions (None without rotary)."""
        rotary = getattr(self.model, "rotary", None)
        return rotary.lookup(positions, self.dtype) if rotary is not None else (None, None)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The model over the plan's inputs: hidden [num_tokens, hidden_size]."""
        input_ids, positions, ctx = self.build(plan)
        with _step_kind(plan.has_prompt, plan.checks):
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
            with _step_kind(plan.has_prompt, plan.checks):  # as rank 0 computes them
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
        if self.drafter is not None:
            self.drafter.propose(batch)
        self.copy_states(batch.restores)
        self.encode_images(batch)
        step = self.forward_step(batch)
        if self.hidden_reader is not None:
            self.hidden_reader(batch, step)
        self.copy_states(batch.snapshots)
        return self.sample(batch, step)

    def forward_step(self, batch: ScheduledBatch) -> StepHidden:
        """The batch's forward: a captured decode graph replayed where one covers the step,
        else the model run eagerly (by every rank, under tensor parallel)."""
        graphs = self.graphs
        hidden = None if graphs is None else graphs.run(self, batch, not self.recurrent_layers)
        if hidden is not None:  # every sequence decodes and samples, in order, check rows too
            rows = [i for i, seq in enumerate(batch.seqs) for _ in range(1 + len(seq.draft))]
            return StepHidden(hidden, None, rows, False, len(rows) > len(batch.seqs))
        plan = self.plan(batch)
        if self.broadcast is not None:  # tensor parallel: the followers run it too
            self.broadcast(_travelling(plan))
        hidden = self.forward(plan)
        # where output_rows is set, the model returned the sampled rows alone, in order
        rows = None if plan.output_rows else plan.sample_rows
        return StepHidden(hidden, rows, plan.sample_seqs, plan.has_prompt, plan.checks)

    def sample(
        self, batch: ScheduledBatch, step: StepHidden
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None, dict[int, Exception]]:
        """The step's logits and tokens, by batch index (see `run`); a speculating row's
        entry is the list of tokens it keeps (spec/verify.py)."""
        out: list[int | None] = [None] * len(batch.seqs)
        errors: dict[int, Exception] = {}
        if not step.seqs:
            return out, None, errors
        seqs = [batch.seqs[i] for i in step.seqs]
        hidden = step.hidden[: len(seqs)] if step.rows is None else step.hidden[step.rows]
        # a prompt step's logits in float32 too (PREFILL_STEP): its first token is the
        # answer's first word, and SmolLM2's "What is the capital of France?" has "The" and
        # "L" within 0.08 of each other there, which the decode kernels' rounding swapped
        with _step_kind(step.has_prompt, step.checks):
            logits = self.model.compute_logits(hidden, seqs)
        # a sampled row's draft is checked on its logits (spec/verify.py), not sampled
        rows_of: dict[int, list[int]] = {}
        for j, i in enumerate(step.seqs):
            if batch.seqs[i].draft and not batch.seqs[i].params.is_greedy:
                rows_of.setdefault(i, []).append(j)
        for i, rows in rows_of.items():
            seq = batch.seqs[i]
            try:
                row_logits = logits[rows]
                if not bool(torch.isfinite(row_logits).all()):
                    raise NonFiniteRowError(f"non-finite logits for request {seq.request_id}")
                out[i] = accepted_sampled(row_logits, seq.draft, seq)
            except Exception as e:
                errors[i] = e
        if rows_of:
            keep = [j for j, i in enumerate(step.seqs) if i not in rows_of]
            if not keep:
                return out, None, errors
            logits, seqs = logits[keep], [seqs[j] for j in keep]
            step_seqs = [step.seqs[j] for j in keep]
        else:
            step_seqs = step.seqs
        sampled = self.step_sampler.sample(logits, seqs)
        logprobs = None if sampled.logprobs is None else [None] * len(batch.seqs)
        checked: dict[int, list[int]] = {}  # greedy speculating rows: the target's choices
        for j, i in enumerate(step_seqs):
            if sampled.errors[j] is not None:
                errors[i] = sampled.errors[j]
                continue
            if batch.seqs[i].draft:
                checked.setdefault(i, []).append(sampled.tokens[j])
                continue
            out[i] = sampled.tokens[j]
            if logprobs is not None:
                logprobs[i] = sampled.logprobs[j]
        for i, targets in checked.items():
            if i not in errors:  # what the row keeps of its draft (a list: see postprocess)
                out[i] = accepted(batch.seqs[i].draft, targets)
        return out, logprobs, errors


def _travelling(plan: StepPlan) -> StepPlan:
    """The plan as it goes to the other ranks: its one tensor (the spliced image
    embeddings) on the CPU."""
    if plan.splice is None or plan.splice.device.type == "cpu":
        return plan
    return dataclasses.replace(plan, splice=plan.splice.cpu())


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
def _step_kind(has_prompt: bool, checks: bool) -> Iterator[None]:
    """PREFILL_STEP and ROWS_ALONE for what runs inside (layers/linear.py), its forward and
    its logits alike: a step that carries prompt tokens computes in float32, and one in which
    a sequence checks a draft computes each row as a one-row step would."""
    prompt, alone = PREFILL_STEP.set(has_prompt), ROWS_ALONE.set(checks)
    try:
        yield
    finally:
        ROWS_ALONE.reset(alone)
        PREFILL_STEP.reset(prompt)
