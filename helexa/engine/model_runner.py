"""Runs one scheduled batch through the model: inputs → forward → logits → tokens.

The runner owns the KV cache tensors and the model; it never decides who runs.
"""

from __future__ import annotations

import math

import torch

from helexa.engine.layers.attention import AttentionContext, PrefillSegment
from helexa.engine.layers.linear import PREFILL_STEP
from helexa.engine.layers.sampler import Sampler
from helexa.engine.scheduler import ScheduledBatch
from helexa.engine.sequence import Sequence, TokenLogprob
from helexa.engine.state_manager import StateCopy


def recurrent_layers(model: torch.nn.Module) -> list:
    """The model's layers that keep a recurrent state per sequence (hybrid models)."""
    return list(getattr(model, "recurrent_layers", ()))


class NonFiniteLogitsError(RuntimeError):
    """Every row of a step's logits was NaN/Inf: a sign of a device fault or bad weights."""


class NonFiniteRowError(RuntimeError):
    """One sequence's logits were NaN/Inf while its batch-mates' were finite: it fails alone."""


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
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler()
        self.attention_layers = model.attention_layers
        self.recurrent_layers = recurrent_layers(model)
        for attn in self.attention_layers:
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        for layer in self.recurrent_layers:
            conv, ssm = layer.state_shapes()
            layer.conv_state = torch.zeros(num_state_slots, *conv, dtype=dtype, device=device)
            # the delta-rule state accumulates over the whole context: kept in float32
            layer.ssm_state = torch.zeros(num_state_slots, *ssm, dtype=torch.float32, device=device)

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
        dev = self.device
        src = torch.tensor([c.src_slot for c in copies], device=dev)
        dst = torch.tensor([c.dst_slot for c in copies], device=dev)
        for layer in self.recurrent_layers:
            layer.conv_state.index_copy_(0, dst, layer.conv_state[src])
            layer.ssm_state.index_copy_(0, dst, layer.ssm_state[src])
        blocks = [(c.src_block, c.dst_block) for c in copies if c.src_block is not None]
        if blocks:
            bsrc = torch.tensor([b[0] for b in blocks], device=dev)
            bdst = torch.tensor([b[1] for b in blocks], device=dev)
            for attn in self.attention_layers:
                attn.k_cache.index_copy_(0, bdst, attn.k_cache[bsrc])
                attn.v_cache.index_copy_(0, bdst, attn.v_cache[bsrc])

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end) of `seq`."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, list[int], list[int]]:
        """Flat inputs for the step: ids, positions, attention context, and for the
        sequences that sample this step their last rows and their batch indices."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        dev = self.device
        row = 0
        for i, seq in enumerate(batch.seqs):
            n = batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_seqs.append(seq)
                slots.extend(self._slots(seq, start, start + 1))
            else:
                context = self._slots(seq, 0, start + n)
                slots.extend(context[start:])
                seg = PrefillSegment(row, row + n, None, state_slot=seq.state_slot)
                if start:
                    seg.context_slots = torch.tensor(context, dtype=torch.long, device=dev)
                    span = start + n
                    seg.mask = torch.ones(n, span, dtype=torch.bool, device=dev).tril(span - n)
                prefills.append(seg)
            row += n
            if batch.samples(i):
                sample_rows.append(row - 1)
                sample_seqs.append(i)

        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        rotary = getattr(self.model, "rotary", None)
        cos, sin = rotary.lookup(pos, self.dtype) if rotary is not None else (None, None)
        ctx = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cos=cos,
            sin=sin,
            prefills=prefills,
            decode_rows=None,
            decode_blocks=None,
            decode_mask=None,
        )
        if decode_seqs:
            self._prepare_decode(ctx, decode_rows, decode_seqs, all_decode=not prefills)
        return input_ids, pos, ctx, sample_rows, sample_seqs

    def _prepare_decode(
        self, ctx: AttentionContext, rows: list[int], seqs: list[Sequence], all_decode: bool
    ) -> None:
        bs = self.block_size
        lengths = [s.num_computed_tokens + 1 for s in seqs]
        max_blocks = -(-max(lengths) // bs)
        table = [s.block_table[:max_blocks] for s in seqs]
        dev = self.device
        ctx.decode_blocks = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in table], dtype=torch.long, device=dev
        )
        span = max_blocks * bs
        if any(n != span for n in lengths):
            pos = torch.arange(span)
            visible = pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
            # additive float mask: SDPA would convert a bool one again in every layer
            mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, -torch.inf)
            ctx.decode_mask = mask[:, None, None, :].to(dev)
        ctx.decode_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        ctx.all_decode = all_decode
        if self.recurrent_layers:
            ctx.decode_state_slots = torch.tensor(
                [s.state_slot for s in seqs], dtype=torch.long, device=dev
            )

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None, dict[int, Exception]]:
        """Forward the batch; sample one token for each sequence that reached its end.

        Returns tokens and logprobs by batch index, and the sequences that failed alone
        (non-finite logits in their row only, or their sampling raised) with the error.
        A failure of the forward pass, or non-finite logits in every row, raises."""
        input_ids, positions, ctx, sample_rows, sample_seqs = self.prepare(batch)
        has_prompt = any(s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs)
        self.copy_states(batch.restores)
        token = PREFILL_STEP.set(has_prompt)
        try:
            hidden = self.model(input_ids, positions, ctx)
        finally:
            PREFILL_STEP.reset(token)
        self.copy_states(batch.snapshots)
        out: list[int | None] = [None] * len(batch.seqs)
        errors: dict[int, Exception] = {}
        if not sample_seqs:
            return out, None, errors
        sampling = [batch.seqs[i] for i in sample_seqs]
        logits = self.model.compute_logits(hidden[sample_rows], sampling)
        if any(s.params.debug_fault == "nonfinite" for s in sampling):
            for j, s in enumerate(sampling):
                if s.params.debug_fault == "nonfinite":
                    logits[j] = torch.nan
        finite = logits.isfinite().all(-1).tolist()
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
            keep = [j for j, ok in enumerate(finite) if ok]
            logits = logits[keep]
            sampling = [sampling[j] for j in keep]
            sample_seqs = [sample_seqs[j] for j in keep]
        tokens, lps, failed = self._sample(logits, sampling)
        out_lps: list[TokenLogprob | None] = [None] * len(batch.seqs)
        for j, i in enumerate(sample_seqs):
            if failed[j] is not None:
                errors[i] = failed[j]
                continue
            out[i] = tokens[j]
            if lps is not None:
                out_lps[i] = lps[j]
        return out, (out_lps if lps is not None else None), errors

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None, list[Exception | None]]:
        """The sampler over the batch; when that raises, again row by row, so that one
        sequence's error fails it alone and the others get the tokens they would have got
        (seeded rows from their generators as they were before the failed attempt)."""
        # logits: [num_seqs, vocab]
        num = len(seqs)
        states = [s.generator.get_state() if s.generator is not None else None for s in seqs]
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
