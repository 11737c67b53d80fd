"""A step's tokens from its logits, where one sequence's failure is its own.

Non-finite logits in some rows only, or a sampler error that one row causes, fail those
sequences alone (`SampledRows.errors`); the others get the tokens they would have got.
Non-finite logits in every row point at the device or the weights, not at a request, and
raise NonFiniteLogitsError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.engine.layers import sampler as sampling_ops
from helexa.engine.layers.sampler import Sampler
from helexa.engine.sequence import Sequence, TokenLogprob


class NonFiniteLogitsError(RuntimeError):
    """Every row of a step's logits was NaN/Inf: a sign of a device fault or bad weights."""


class NonFiniteRowError(RuntimeError):
    """One sequence's logits were NaN/Inf while its batch-mates' were finite: it fails alone."""


@dataclass(slots=True)
class SampledRows:
    """One entry per row of the logits: its token, or the error it failed with."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None] | None  # None: no row asked for logprobs
    errors: list[Exception | None]


class StepSampler:
    def __init__(self) -> None:
        self.sampler = Sampler()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledRows:
        """A token for each row of logits [num_seqs, vocab], sequence seqs[row]'s. A step
        that asks for no logprobs reads back only its tokens and each row's finiteness, in
        one copy."""
        _inject_faults(logits, seqs)
        finite_rows = sampling_ops.finite_rows(logits)
        # seeded rows' generators as they were, for a retry row by row after a failed attempt
        states = [q.generator.get_state() if q.generator is not None else None for q in seqs]
        wants_logprobs = any(q.params.logprobs is not None for q in seqs)
        fast = None if wants_logprobs else self._sample_fast(logits, seqs, finite_rows)
        finite = fast[1] if fast is not None else finite_rows.tolist()
        if not any(finite):  # a lone sequence, or all of them: the device, not a request
            bad = [s.request_id for s in seqs]
            raise NonFiniteLogitsError(f"non-finite logits for requests {bad}")
        errors: list[Exception | None] = [
            None if ok else NonFiniteRowError(
                f"non-finite logits for request {seq.request_id} "
                "while its batch-mates' were finite"
            )
            for seq, ok in zip(seqs, finite, strict=True)
        ]  # fmt: skip
        if fast is not None:  # rows sample independently: the finite rows' tokens stand
            tokens = [t if ok else None for t, ok in zip(fast[0], finite, strict=True)]
            return SampledRows(tokens, None, errors)
        keep = [j for j, ok in enumerate(finite) if ok]
        if len(keep) < len(seqs):
            logits = logits[keep]
        # the whole batch at once, unless the fast path just failed at that
        kept = self._sample(
            logits, [seqs[j] for j in keep], [states[j] for j in keep], whole_batch=wants_logprobs
        )
        out = SampledRows([None] * len(seqs), None, errors)
        if kept.logprobs is not None:
            out.logprobs = [None] * len(seqs)
        for kept_row, j in enumerate(keep):
            if kept.errors[kept_row] is not None:
                errors[j] = kept.errors[kept_row]
                continue
            out.tokens[j] = kept.tokens[kept_row]
            if out.logprobs is not None:
                out.logprobs[j] = kept.logprobs[kept_row]
        return out

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
    ) -> SampledRows:
        """The sampler over the batch (when `whole_batch`); when that raises, or was already
        tried, row by row, so that one sequence's error fails it alone and the others get the
        tokens they would have got (seeded rows from their generators' `states` before any
        attempt)."""
        # logits: [num_seqs, vocab]
        num = len(seqs)
        if whole_batch:
            try:
                tokens, lps = self.sampler(logits, seqs)
                return SampledRows(tokens, lps, [None] * num)
            except Exception:
                pass  # found again below, row by row
        out = SampledRows([None] * num, [None] * num, [None] * num)
        for j, (seq, state) in enumerate(zip(seqs, states, strict=True)):
            if seq.generator is not None and state is not None:
                seq.generator.set_state(state)
            try:
                row_tokens, row_lps = self.sampler(logits[j : j + 1], [seq])
            except Exception as e:
                out.errors[j] = e
                continue
            out.tokens[j] = row_tokens[0]
            if row_lps is not None:
                out.logprobs[j] = row_lps[0]
        if not any(s.params.logprobs is not None for s in seqs):
            out.logprobs = None
        return out


def _inject_faults(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """NaN logits for the rows whose request asked for them (`debug_fault`, tests)."""
    for j, s in enumerate(seqs):
        if s.params.debug_fault == "nonfinite":
            logits[j] = torch.nan
