"""Books for hybrid models' recurrent state (Gated DeltaNet conv + delta-rule state): which
row of the state pools each running sequence holds, and the prefix snapshots. No tensors.

A recurrent state cannot be rewound, so the KV prefix cache alone cannot resume a hybrid
model mid-prompt: a prompt resumes only from a snapshot of the state taken at exactly the
position it resumes from. Snapshots are taken right after the last special token of a
prompt (`<|im_start|>` of the assistant turn): special tokens are hard segmentation points,
so every later render of the conversation tokenizes identically up to there, while the
text after it (`assistant\\n` + the reply) may merge differently under BPE. A later prompt
that starts with a snapshot's tokens resumes from it: its state row is copied in, its full
KV blocks come from the block manager's prefix index, and the partial block at the
boundary from the snapshot's own copy of it.

Pools hold `max_num_seqs` rows for running sequences plus `max_snapshots` for snapshots, so
a running sequence always finds a row; snapshots are dropped least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from helexa.engine.block_manager import BlockManager
from helexa.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Snapshot:
    """The recurrent state after `tokens`, and the KV of their last partial block."""

    tokens: list[int]  # as the prefix cache knows them (Sequence.cache_ids)
    slot: int  # its row of the state pools
    tail_block: int | None  # a block holding positions [len // bs * bs, len), or None

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class StateCopy:
    """A copy the model runner makes: state row src → dst, and KV block src → dst if any."""

    src_slot: int
    dst_slot: int
    src_block: int | None = None
    dst_block: int | None = None


class StateManager:
    def __init__(
        self,
        max_num_seqs: int,
        max_snapshots: int,
        block_manager: BlockManager,
        special_ids: set[int],
    ) -> None:
        self.num_slots = max_num_seqs + max_snapshots
        self.max_snapshots = max_snapshots
        self.block_manager = block_manager
        self.special_ids = special_ids
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()  # by id, oldest use first
        self._pending: dict[int, Snapshot] = {}  # reserved, filled by the running step

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    # -- running sequences -------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        assert seq.state_slot < 0 and self._free, "allocate() twice or pools exhausted"
        seq.state_slot = self._free.pop()

    def free(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1

    # -- rows lent for one step (speculative decoding: spec/rollback.py) ---------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def lend(self) -> int | None:
        """A free row until the step's postprocess, or None. Only once the step's admissions
        and snapshot reservations are done: they count on every free row."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def move(self, seq: Sequence, slot: int) -> None:
        """`seq`'s state now lives in the lent row `slot`; its old row goes back."""
        self._free.append(seq.state_slot)
        seq.state_slot = slot

    # -- snapshots ---------------------------------------------------------------------
    def snapshot_point(self, seq: Sequence, cached: int) -> int | None:
        """Where to snapshot `seq`, resuming after `cached` tokens: right after the last
        special token of its prompt, unless that is not past `cached` or a snapshot of those
        tokens exists already."""
        prompt = seq.prompt_token_ids
        at = next(
            (i + 1 for i in range(len(prompt) - 1, 0, -1) if prompt[i] in self.special_ids), 0
        )
        return at if at > cached and not self.has(seq.cache_ids[:at]) else None

    def match(self, seq: Sequence, num_full_blocks: int) -> Snapshot | None:
        """The longest snapshot `seq` can resume from: its tokens start `seq`'s, at least one
        token is left to compute, and its full KV blocks are among the `num_full_blocks`
        the prefix index found."""
        bs = self.block_manager.block_size
        tokens = seq.cache_ids  # an image's run keyed by its pixels
        best: Snapshot | None = None
        for snap in self._snapshots.values():
            n = snap.length
            if (
                n < len(tokens)
                and n // bs <= num_full_blocks
                and (best is None or n > best.length)
                and tokens[:n] == snap.tokens
            ):
                best = snap
        if best is not None:
            self._snapshots.move_to_end(id(best))
        return best

    def has(self, tokens: list[int]) -> bool:
        n = len(tokens)
        return any(s.length == n and s.tokens == tokens for s in self._snapshots.values())

    def reserve(self, seq: Sequence, length: int) -> tuple[Snapshot, StateCopy] | None:
        """Room for a snapshot of `seq` after its first `length` tokens, and the copy that
        fills it once the step has computed them; None when no KV block is free for the
        partial block."""
        if self.max_snapshots == 0:
            return None
        while len(self._snapshots) + len(self._pending) >= self.max_snapshots:
            if not self._snapshots:
                return None
            self._drop(next(iter(self._snapshots.values())))
        bs = self.block_manager.block_size
        tail = None
        if length % bs:
            tail = self.block_manager.take_block()
            if tail is None:
                return None
        snap = Snapshot(tokens=seq.cache_ids[:length], slot=self._free.pop(), tail_block=tail)
        self._pending[id(snap)] = snap
        copy = StateCopy(
            src_slot=seq.state_slot,
            dst_slot=snap.slot,
            src_block=seq.block_table[length // bs] if tail is not None else None,
            dst_block=tail,
        )
        return snap, copy

    def commit(self, snap: Snapshot) -> None:
        """Index a filled snapshot; the ones it extends (earlier turns) are dropped."""
        del self._pending[id(snap)]
        for old in list(self._snapshots.values()):
            if old.length < snap.length and snap.tokens[: old.length] == old.tokens:
                self._drop(old)
        self._snapshots[id(snap)] = snap

    def discard(self, snap: Snapshot) -> None:
        """Give back a reserved snapshot whose step failed."""
        del self._pending[id(snap)]
        self._release(snap)

    def evict_one(self) -> bool:
        """Drop the least recently used snapshot that holds a KV block (the pool is dry)."""
        for snap in self._snapshots.values():
            if snap.tail_block is not None:
                self._drop(snap)
                return True
        return False

    def restore(self, seq: Sequence, snap: Snapshot) -> StateCopy:
        """The copy that resumes `seq` (its row allocated, its blocks grown past the
        boundary) from `snap`."""
        bs = self.block_manager.block_size
        return StateCopy(
            src_slot=snap.slot,
            dst_slot=seq.state_slot,
            src_block=snap.tail_block,
            dst_block=seq.block_table[snap.length // bs] if snap.tail_block is not None else None,
        )

    def _drop(self, snap: Snapshot) -> None:
        del self._snapshots[id(snap)]
        self._release(snap)

    def _release(self, snap: Snapshot) -> None:
        self._free.append(snap.slot)
        if snap.tail_block is not None:
            self.block_manager.release_block(snap.tail_block)
