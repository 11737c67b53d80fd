"""The MTP head as a drafter (vLLM's "mtp"): the head's one attention layer keeps a KV cache
of the target's number of blocks and block size, addressed by the target's block tables and
slots, so it keeps no books of its own.

The head's KV at position i comes from the embedding of token i+1 and the target's hidden
state at i: it can be computed only once the target has computed position i and token i+1
is known, which for a sequence's last position is after the step's sampling. So the head
lags the target by a step:
  - after each target forward (`observe`), every row's hidden states are held, with the
    tokens the row fed (prompt chunks included, so the head's cache covers the prompt);
  - before the next forward (`propose`), the head runs once over each row's held positions
    whose fed tokens still stand (a rejected draft's do not; a hybrid row that rolled back
    keeps those before the first rejection), reading token i+1 at position i. A speculating
    row's last held position is the one before its last token: the head's output there
    predicts the token after the last, d1;
  - d2..dk: k-1 one-row forwards per speculating row, each feeding the draft before it at
    the next position with the head's own output as the hidden state (vLLM's rule). Their
    KV lies past what the target has computed and is written over with the target's hidden
    states a step later.
Drafts are the head's argmax, a point mass, for which verify.accepted_sampled's rule is
exact. The held states of a sequence not in a step wait for its next one; a preempted
sequence's are dropped once it restarts below them.

What the head's cache holds short of exact only lowers acceptance: a cached prefix's head KV
(its last position read the next token of whoever computed it), an image prompt's rows (the
head runs them at text positions), a step that failed (its rows are not held; the next
drafts read stale KV, and a row with no held state drafts its last token again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from helexa.engine.layers.linear import PREFILL_STEP
from helexa.engine.model_runner import ModelRunner, StepHidden
from helexa.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from helexa.engine.sequence import Sequence
    from helexa.engine.spec.mtp import MtpHead


@dataclass(slots=True)
class _Held:
    """A sequence's hidden states from the target's last forward of it: positions start..,
    and the tokens it fed there."""

    seq: Sequence
    start: int
    ids: list[int]
    hidden: torch.Tensor  # [len(ids), hidden_size]


@dataclass(slots=True, eq=False)
class _Row:
    """A sequence as one of the head's forwards reads it (what ModelRunner.plan reads of a
    Sequence): `n` positions from `start`, its blocks; the plan's token ids are replaced by
    the head's (the token after each position)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    position_offset: int = 0
    draft: list[int] = field(default_factory=list)
    mm: None = None
    state_slot: int = -1


def _row(seq: Sequence, start: int, n: int) -> _Row:
    tokens = seq.token_ids
    return _Row(
        tokens, start, start + n, seq.block_table, seq.num_prompt_tokens, seq.position_offset
    )


class MtpDrafter:
    """The head's runner over a cache the target's blocks address; `observe` holds each
    target forward's hidden states, `propose` fills the next step's drafts (see the module's
    docstring)."""

    def __init__(
        self,
        head: MtpHead,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
    ) -> None:
        self.head = head
        self.runner = ModelRunner(
            head, device=device, dtype=dtype, num_blocks=num_blocks, block_size=block_size,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        self.vocab_size = vocab_size  # the target's logits' width: no proposal past it
        self._held: dict[int, _Held] = {}  # by seq_id

    @property
    def model(self) -> torch.nn.Module:
        return self.head

    def attach(self, runner: ModelRunner) -> None:
        """Draft for `runner`'s steps: its forward returns every row's hidden state (not the
        sampled rows' alone), and each comes here."""
        runner.drafter = self
        runner.hidden_reader = self.observe
        runner.selects_output_rows = False

    def observe(self, batch: ScheduledBatch, step: StepHidden) -> None:
        """After the target's forward: hold each row's hidden states and fed tokens."""
        # a decode graph's output buffer is overwritten by its next replay: copied
        hidden = step.hidden[: batch.num_tokens].clone()
        assert hidden.shape[0] == batch.num_tokens, (hidden.shape, batch.num_tokens)
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids = [*seq.token_ids[start : start + n], *seq.draft]
            self._held[seq.seq_id] = _Held(seq, start, ids, hidden[row : row + n])
            row += n
        self.runner.copy_states(batch.snapshots)  # a hybrid target's snapshot blocks too

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Run the head over the rows' held positions and write each speculating row's draft
        (the scheduler's placeholders, one per token it reserved) into seq.draft."""
        self.runner.copy_states(batch.restores)  # a snapshot's partial block, here too
        self._held = {i: h for i, h in self._held.items() if not h.seq.is_finished}
        rows, news, ids, hiddens = [], [], [], []
        last: dict[int, int] = {}  # batch index of a speculating row -> its d1 row
        for i, seq in enumerate(batch.seqs):
            held = self._held.pop(seq.seq_id, None)
            n = 0 if held is None else _standing(seq, held)
            if n == 0:
                continue
            rows.append(_row(seq, held.start, n))
            news.append(n)
            ids.extend(seq.token_ids[held.start + 1 : held.start + n + 1])
            hiddens.append(held.hidden[:n])
            if seq.draft and held.start + n == seq.num_tokens - 1:
                last[i] = len(ids) - 1
        drafts: dict[int, list[int]] = {}
        outs: dict[int, torch.Tensor] = {}  # each drafting row's latest out [1, H]
        if rows:
            out = self._forward(rows, news, ids, torch.cat(hiddens))
            picks = list(last)
            tokens = self._argmax(out[[last[i] for i in picks]])
            outs = {i: out[last[i] : last[i] + 1] for i in picks}
            drafts = {i: [t] for i, t in zip(picks, tokens, strict=True)}
        # d2..dk: each growing row feeds its latest draft at the next position
        j = 1
        while growing := [i for i in drafts if len(drafts[i]) < len(batch.seqs[i].draft)]:
            seqs = [batch.seqs[i] for i in growing]
            rows = [_row(seq, seq.num_tokens - 2 + j, 1) for seq in seqs]
            out = self._forward(
                rows, [1] * len(rows), [drafts[i][-1] for i in growing],
                torch.cat([outs[i] for i in growing]),
            )  # fmt: skip
            for r, (i, token) in enumerate(zip(growing, self._argmax(out), strict=True)):
                drafts[i].append(token)
                outs[i] = out[r : r + 1]
            j += 1
        for i, seq in enumerate(batch.seqs):
            if seq.draft:  # no held state (a failed step): its last token, likely rejected
                seq.draft = drafts.get(i) or [seq.token_ids[-1]] * len(seq.draft)

    def _forward(
        self, rows: list[_Row], news: list[int], ids: list[int], hidden: torch.Tensor
    ) -> torch.Tensor:
        """The head over `rows` (`news` positions each), reading `ids` (the token after each
        position) and `hidden` [sum(news), H] -> its out at every position."""
        runner = self.runner
        plan = runner.plan(ScheduledBatch(rows, news))  # type: ignore[arg-type] (as Sequences)
        plan.ids = ids
        input_ids, positions, ctx = runner.build(plan)
        token = PREFILL_STEP.set(plan.has_prompt)
        try:
            return self.head(input_ids, positions, hidden, ctx)
        finally:
            PREFILL_STEP.reset(token)

    def _argmax(self, out: torch.Tensor) -> list[int]:
        """The draft token at each row of the head's out [m, H] (the target's lm_head)."""
        if not out.shape[0]:
            return []
        return self.head.compute_logits(out)[:, : self.vocab_size].argmax(dim=-1).tolist()


def _standing(seq: Sequence, held: _Held) -> int:
    """How many of `held`'s positions the head may read now: those whose fed tokens are
    still the sequence's (not a rejected draft's) and have a token after them; none where the
    sequence restarted below them (preempted since)."""
    if held.start > seq.num_computed_tokens:
        return 0
    tokens, limit = seq.token_ids, min(len(held.ids), seq.num_tokens - 1 - held.start)
    n = 0
    while n < limit and held.ids[n] == tokens[held.start + n]:
        n += 1
    return n
