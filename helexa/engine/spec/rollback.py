"""Speculative decoding on hybrid models: the recurrent state rolls back past rejected drafts.

A Gated DeltaNet layer folds every token it reads into its conv and delta-rule states, so a
step that checks [last token, d1..dk] leaves them past all k drafts, rejected ones too; the
attention layers' KV of a rejected draft only lies past `num_computed_tokens` and is written
over. Two ways back to the last accepted token (issue 38): keep a checkpoint of the state
after every position of the check, or keep the state from before the step and recompute.
This is the recompute: before the forward the runner copies the row's state into a row lent
for the step (a `StateCopy` among the step's restores). A step that keeps every draft leaves
the state right, and the lent row goes back. A step that rejects some keeps the tokens it
accepted and the target's own, but not their state: the row moves to the lent row, which
holds the state from before the step (no copy back: the books swap rows, so tensor-parallel
ranks, which take each step's rows from rank 0's plan, follow), its old row goes back, and
`num_computed_tokens` returns to where it was, so the next step feeds those tokens again as
its first rows (through the chunk path, from that state) with a new draft after them.

Why recompute, measured on this project's 2-core CPU host in float32 over one Gated DeltaNet
layer of Qwen3-Next's shape (hidden 2048, Hv 32, K = V = 128: a 2.1 MiB state row): copying
a state row takes 0.4 ms, the k+1 = 5 copies a checkpoint per position makes every step,
whatever is accepted, 1.3-1.6 ms; the layer's 5-row check chunk takes ~22 ms (its weights'
reads), and 1-3 recomputed rows more in it are lost in that time's noise (5 more: +1.5 ms).
Checkpoints would also need the chunk kernel to write the state after every position, which
the chunked delta rule does not keep. On the tests' prompts (20% of draft tokens accepted)
87% of check steps roll back, and the steps after them feed 2.8 rows more a check step.

No row is ever lent at anyone's expense: a row is lent only once the step's admissions and
snapshot reservations are done, from what is free then; with none free the row drops its
draft and decodes one token. A row still recomputing after rejections in a row drafts only
while its recomputed tokens stay within `max_rows` (1 + num_speculative_tokens), so a run of
rejections never grows the recompute without bound: past it the row computes its tokens
without a draft and its state is right again.
"""

from __future__ import annotations

from typing import Protocol

from helexa.engine.sequence import Sequence
from helexa.engine.state_manager import StateCopy, StateManager


class Batch(Protocol):
    """What the rollback reads and writes of a scheduler.ScheduledBatch (the scheduler
    imports this module): its rows, their token counts, the state copies before the forward."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    restores: list[StateCopy]


class StateRollback:
    """The rows lent for this step's speculating hybrid rows, by sequence id."""

    def __init__(self, state_manager: StateManager, max_rows: int) -> None:
        self.state_manager = state_manager
        self.max_rows = max_rows  # tokens a row may recompute and still draft
        self._lent: dict[int, int] = {}  # seq_id -> the row holding its state before the step
        self.num_rollbacks = 0
        self.num_recomputed_tokens = 0  # rows fed again, past the one a decode step feeds

    def can_draft(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`, computing its last `n` tokens (all past its prompt), may draft: it
        recomputes no more than max_rows and a row is free to keep its state in."""
        return (
            seq.num_computed_tokens >= seq.num_prompt_tokens
            and n <= self.max_rows
            and self.state_manager.num_free > 0
        )

    def guard(self, batch: Batch) -> None:
        """At the end of scheduling: each row with a draft gets a lent row and the copy of
        its state into it before the forward, or, with none free, drops its draft."""
        for i, seq in enumerate(batch.seqs):
            if not seq.draft:
                continue
            slot = self.state_manager.lend()
            if slot is None:  # never at anyone's expense: the row decodes without a draft
                batch.num_new_tokens[i] -= len(seq.draft)
                seq.draft = []
                continue
            self._lent[seq.seq_id] = slot
            batch.restores.append(StateCopy(src_slot=seq.state_slot, dst_slot=slot))

    def settle(self, seq: Sequence, start: int, kept_all: bool) -> None:
        """After the step: with every draft kept (or the sequence finished) the state is
        right and the lent row goes back; else the row rolls back to `start`, the tokens
        computed before the step, and recomputes the rest next step."""
        slot = self._lent.pop(seq.seq_id)
        if kept_all or seq.is_finished:
            self.state_manager.give_back(slot)
            return
        self.state_manager.move(seq, slot)
        seq.num_computed_tokens = start
        self.num_rollbacks += 1
        self.num_recomputed_tokens += seq.num_tokens - start - 1

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s lent row if it still holds one (its step failed for it)."""
        slot = self._lent.pop(seq.seq_id, None)
        if slot is not None:
            self.state_manager.give_back(slot)

    def release_all(self) -> None:
        """A step that failed: every lent row goes back."""
        for slot in self._lent.values():
            self.state_manager.give_back(slot)
        self._lent.clear()
