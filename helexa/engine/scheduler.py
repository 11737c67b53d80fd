"""Who runs this step: continuous batching with chunked prefill and preemption.

The scheduler never touches tensors. Each step it spends a token budget: running
sequences first (one token each while decoding, a chunk while prefilling), then new
ones from the waiting queue. When the KV pool runs dry the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from helexa.engine.block_manager import BlockManager
from helexa.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from helexa.engine.spec import verify
from helexa.engine.spec.ngram import NgramIndex
from helexa.engine.spec.policy import DraftPolicy
from helexa.engine.spec.rollback import StateRollback
from helexa.engine.state_manager import Snapshot, StateCopy, StateManager
from helexa.engine.vision.prompt import PromptImage


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None  # None: up to the whole step budget
    # speculative decoding (helexa/engine/spec): "ngram", "draft_model", "mtp" or None, and
    # its draft's bounds
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5


@dataclass(slots=True)
class ScheduledBatch:
    """Sequences to run this step and how many new tokens each feeds the model."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    # Hybrid models: state copies the runner makes before the forward (resuming from
    # snapshots) and after it (filling snapshots), and the snapshots those fill, by seq.
    restores: list[StateCopy] = field(default_factory=list)
    snapshots: list[StateCopy] = field(default_factory=list)
    pending: dict[int, Snapshot] = field(default_factory=dict)
    # images the vision tower encodes before the forward: their runs start in this step's
    # chunks and their output is not held yet
    encodes: list[PromptImage] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step (and so samples one; a row
        with a draft samples at each of its tokens)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens + len(seq.draft)


def _seeded(seq: Sequence) -> bool:
    """Whether `seq` samples from a seeded generator (its tokens must repeat run to run)."""
    return seq.params.seed is not None and not seq.params.is_greedy


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        state_manager: StateManager | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.state_manager = state_manager  # hybrid models only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # speculative decoding: drafts checked, their tokens and, of those, the ones accepted
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._encoder_budget = 0  # of the step being scheduled (see _images)
        # which drafts a step checks, from what steps cost here (spec/policy.py)
        self.policy = DraftPolicy() if config.speculative_method is not None else None
        # hybrid models that speculate: the state from before a draft's step (spec/rollback.py)
        self.rollback = (
            StateRollback(state_manager, 1 + config.num_speculative_tokens)
            if state_manager is not None and config.speculative_method is not None
            else None
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        chunk = self.config.max_prefill_chunk or budget
        # the vision tower's share: an image's tokens each step, besides the decoder's
        self._encoder_budget = self.config.max_num_batched_tokens
        bm, sm = self.block_manager, self.state_manager
        batch = ScheduledBatch([], [])
        seqs, counts = batch.seqs, batch.num_new_tokens

        # Running sequences first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            seq.draft = []  # a failed step's (discard) never carries over
            n = self._chunk(seq, min(seq.num_tokens - seq.num_computed_tokens, chunk, budget))
            n, images = self._images(batch, seq, n)
            if self._may_draft(seq, n):
                n += self._draft(seq, budget - n)
            if n == 0:  # its next image waits for the tower's budget: the next step
                i += 1
                continue
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                if seq.draft:  # a draft never preempts anyone: the row decodes one token
                    n -= len(seq.draft)
                    seq.draft = []
                    continue
                if sm is not None and sm.evict_one():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, seq.num_computed_tokens + n)
                seqs.append(seq)
                counts.append(n)
                self._encode(batch, images)
                self._maybe_snapshot(batch, seq, n)
                budget -= n
                i += 1
                continue
            break  # `seq` itself was preempted; everything after it already was

        if self.policy is not None:  # the drafts worth their rows on this machine now
            budget += self._worth_checking(batch)

        # Then admit waiting sequences while budget, slots and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.match_prefix(seq)
            snap = None
            if sm is not None:  # a recurrent state resumes only from a snapshot
                snap = sm.match(seq, len(seq.block_table))
                cached = snap.length if snap is not None else 0
                bm.truncate(seq, cached // bm.block_size)
                seq.snapshot_at = sm.snapshot_point(seq, cached)
            seq.num_computed_tokens = cached
            n = self._chunk(seq, min(seq.num_tokens - cached, chunk, budget))
            n, images = self._images(batch, seq, n)
            if n == 0 or not bm.can_allocate(seq, cached + n):
                bm.free(seq)  # waiting sequences never hold blocks, or they could deadlock
                seq.num_computed_tokens = 0
                break
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
                seq.num_cache_written_tokens = self._cache_written(seq, cached)
            bm.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            if sm is not None:
                sm.allocate(seq)
                if snap is not None:
                    batch.restores.append(sm.restore(seq, snap))
                self._maybe_snapshot(batch, seq, n)
            self._encode(batch, images)
            budget -= n

        if self.rollback is not None:  # admissions done: drafts may take the rows left free
            self.rollback.guard(batch)
        return batch if seqs else None

    def _worth_checking(self, batch: ScheduledBatch) -> int:
        """Cut the running rows' drafts to what spec/policy.py finds worth checking, from
        this machine's measured step costs and each row's acceptance, on a step of decoding
        rows (a step with a prompt chunk is priced by it, and keeps its drafts); returns the
        budget given back."""
        # a seeded sampled row keeps its draft whatever the costs: which drafts are checked
        # decides which random draws its tokens take, and a seed must repeat its tokens
        rows = [i for i, seq in enumerate(batch.seqs) if seq.draft and not _seeded(seq)]
        if not rows or any(s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs):
            return 0
        drafts = [(batch.seqs[i].draft_acceptance, len(batch.seqs[i].draft)) for i in rows]
        base = batch.num_tokens - sum(k for _, k in drafts)
        freed = 0
        for i, keep in zip(rows, self.policy.choose(base, drafts), strict=True):
            seq = batch.seqs[i]
            cut = len(seq.draft) - keep
            seq.draft = seq.draft[:keep]
            if not keep:  # unchecked, it drifts back to be tried again
                seq.draft_acceptance = DraftPolicy.unchecked(seq.draft_acceptance)
            batch.num_new_tokens[i] -= cut
            freed += cut
        return freed

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's wall time, for the draft policy: decode steps only (every row past its
        prompt), by their rows, check rows included."""
        if self.policy is not None and all(
            s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs
        ):
            self.policy.observe(batch.num_tokens, seconds)

    def _may_draft(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`'s `n` tokens this step end at its last and follow its prompt, so a
        draft may follow them: one token while decoding (the prompt's last is not), or, on a
        hybrid model, the tokens a rolled-back step kept (spec/rollback.py)."""
        if not seq.num_output_tokens or seq.num_computed_tokens + n != seq.num_tokens:
            return False
        if self.rollback is not None:
            return self.rollback.can_draft(seq, n)
        return n == 1

    def _draft(self, seq: Sequence, room: int) -> int:
        """Draft the decoding `seq`'s next tokens (seq.draft) when it speculates: at most
        num_speculative_tokens, `room` in the step's budget, and one fewer than its
        max_tokens leaves (the target adds one of its own). Returns the draft's length."""
        cfg = self.config
        seq.draft = []
        if cfg.speculative_method is None or not verify.speculates(seq):
            return 0
        k = min(cfg.num_speculative_tokens, room, seq.max_tokens - seq.num_output_tokens - 1)
        if k < 1:
            return 0
        if cfg.speculative_method in ("draft_model", "mtp"):
            # k placeholders, so the budget and the blocks are right: the runner's draft
            # model or MTP head writes its tokens over them before the forward
            # (spec/draft_model.py, spec/mtp_drafter.py)
            seq.draft = [-1] * k
            return k
        index = seq.drafter_state
        if index is None:
            index = seq.drafter_state = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        seq.draft = index.propose(seq.token_ids, k)
        return len(seq.draft)

    def _images(
        self, batch: ScheduledBatch, seq: Sequence, n: int
    ) -> tuple[int, list[PromptImage]]:
        """`n` new tokens for `seq`, cut before the first image its chunk reaches that the
        tower has no budget left for this step (one image a step always fits: progress),
        and the images its chunk has the tower encode (`_encode` once it is scheduled)."""
        mm = seq.mm
        start = seq.num_computed_tokens
        todo: list[PromptImage] = []
        if mm is None or start >= seq.num_prompt_tokens:
            return n, todo
        budget = self._encoder_budget
        for p in mm.overlapping(start, start + n):
            if p.embeds is not None or p in batch.encodes:
                continue
            cost = p.run.length
            if cost > budget and (batch.encodes or todo):
                n = max(0, p.run.offset - start)
                break
            budget -= cost
            todo.append(p)
        return n, todo

    def _encode(self, batch: ScheduledBatch, images: list[PromptImage]) -> None:
        """A scheduled chunk's images join the step's encodes and take their budget."""
        batch.encodes.extend(images)
        self._encoder_budget -= sum(p.run.length for p in images)

    def _chunk(self, seq: Sequence, n: int) -> int:
        """`n` new tokens for `seq`, cut so a chunk ends at its snapshot boundary."""
        at = seq.snapshot_at
        if at is not None and seq.num_computed_tokens < at:
            return min(n, at - seq.num_computed_tokens)
        return n

    def _cache_written(self, seq: Sequence, cached: int) -> int:
        """The prompt tokens past `cached` that computing `seq` stores for later requests to
        reuse: its full blocks (their hashes join the prefix index once computed); for a
        hybrid model, the tokens up to its snapshot, if it takes one (only a snapshot
        resumes a recurrent state); 0 with prefix caching off."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return 0
        if self.state_manager is not None:
            at = seq.snapshot_at
            return at - cached if at is not None else 0
        full = seq.num_prompt_tokens // bm.block_size * bm.block_size
        return max(0, full - cached)

    def _maybe_snapshot(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """Reserve a snapshot when this step computes `seq` up to its boundary."""
        if seq.snapshot_at is None or seq.num_computed_tokens + n != seq.snapshot_at:
            return
        seq.snapshot_at = None
        reserved = self.state_manager.reserve(seq, seq.num_computed_tokens + n)
        if reserved is not None:
            snap, copy = reserved
            batch.snapshots.append(copy)
            batch.pending[seq.seq_id] = snap

    def discard(self, batch: ScheduledBatch) -> None:
        """A step that failed fills no snapshot: give back what it reserved."""
        for snap in batch.pending.values():
            self.state_manager.discard(snap)
        batch.pending.clear()
        if self.rollback is not None:
            self.rollback.release_all()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        if seq.mm is not None:  # encoded again when its runs come round again
            seq.mm.drop_embeds()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[int | None],
        logprobs: list[TokenLogprob | None] | None = None,
        errors: dict[int, Exception] | None = None,
    ) -> list[Sequence]:
        """Advance computed counts, append sampled tokens; return sequences that finished.

        A sequence with an error (`errors` by batch index, or raised while its token is
        appended: its detokenizer, its stop strings) fails alone: it finishes with that
        error and its blocks are freed, and its batch-mates go on."""
        finished = []
        for i, seq in enumerate(batch.seqs):
            error = errors.get(i) if errors else None
            if error is None:
                try:
                    token = sampled[i]
                    if isinstance(token, list):  # a draft checked: what it kept, and the next
                        self._keep(seq, token, batch.num_new_tokens[i])
                    else:
                        seq.num_computed_tokens += batch.num_new_tokens[i]
                        self.block_manager.register_computed(seq)
                        if seq.mm is not None:
                            seq.mm.release(seq.num_computed_tokens)
                        if token is not None:
                            seq.append_token(token, logprobs[i] if logprobs else None)
                except Exception as e:
                    error = e
                finally:
                    seq.draft = []
                    if self.rollback is not None:  # a row that failed: its lent row back
                        self.rollback.release(seq)
            snap = batch.pending.pop(seq.seq_id, None)
            if snap is not None:
                if error is None:
                    self.state_manager.commit(snap)
                else:
                    self.state_manager.discard(snap)
            if error is not None:
                seq.fail(error)
            if seq.is_finished:
                self._remove(seq)
                finished.append(seq)
        return finished

    def _keep(self, seq: Sequence, tokens: list[int], n: int) -> None:
        """A speculating row's step of `n` tokens (its own, then its draft): `tokens` (the
        accepted drafts, then the target's own) appended until one finishes the sequence.
        The KV computed stands for the row's own tokens and each kept draft; a rejected
        draft's slots are written over. A hybrid row that rejected some rolls back
        (spec/rollback.py)."""
        start = seq.num_computed_tokens
        self.num_drafts += 1
        self.num_draft_tokens += len(seq.draft)
        self.num_accepted_tokens += len(tokens) - 1
        seq.draft_acceptance = DraftPolicy.acceptance(
            seq.draft_acceptance, len(seq.draft), len(tokens) - 1
        )
        kept = 0
        for token in tokens:
            seq.append_token(token)
            kept += 1
            if seq.is_finished:
                break
        seq.num_computed_tokens += n - len(seq.draft) - 1 + kept
        if self.rollback is not None:
            self.rollback.settle(seq, start, kept_all=len(tokens) > len(seq.draft))
        self.block_manager.register_computed(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                self._remove(seq)
                seq.abort()
                return seq
        return None

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.state_manager is not None:
            self.state_manager.free(seq)
