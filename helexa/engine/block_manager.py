"""Books for the paged KV cache: which blocks each sequence owns, which are free, which
full blocks hold which token prefix (so a new prompt can reuse them). No tensors here."""

from __future__ import annotations

from collections import OrderedDict

from helexa.engine.sequence import Sequence


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full and computed
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Ref-counted KV blocks with a free list and a prefix index over full blocks.

    Freed blocks keep their contents and hash until they are handed out again, least
    recently freed first, so a later prompt with the same prefix can pick them back up.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # Per sequence: how many of its blocks are already registered in the prefix index.
        self._num_hashed: dict[int, int] = {}
        # Prefix-cache counters (prompt tokens looked up / found), for metrics.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens of KV in total."""
        return self.num_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    # -- allocation --------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table so it holds `num_tokens` tokens of KV."""
        need = self.num_blocks_needed(seq, num_tokens)
        assert need <= self.num_free_blocks, "allocate() without can_allocate()"
        for _ in range(need):
            seq.block_table.append(self._pop_free())

    def _pop_free(self) -> int:
        """The least recently freed block, its cached prefix forgotten, held once."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self._by_hash.get(block.block_hash) == block_id:
                del self._by_hash[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence.

        Returns the number of tokens whose KV is reused. At least one token is always
        left to compute, since the last prompt position must produce logits.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        tokens = seq.cache_ids  # the token ids, an image's run keyed by its pixels
        num_full = (len(tokens) - 1) // bs
        prev_hash: int | None = None
        for i in range(num_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((prev_hash, chunk))
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            prev_hash = h
        self._num_hashed[seq.seq_id] = len(seq.block_table)
        self.num_prefix_queries += len(tokens)
        self.num_prefix_hits += len(seq.block_table) * bs
        return len(seq.block_table) * bs

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Keep only the first `num_blocks` of a new sequence's matched prefix blocks."""
        extra = seq.block_table[num_blocks:]
        for block_id in reversed(extra):
            self._unref(block_id)
        del seq.block_table[num_blocks:]
        self.num_prefix_hits -= len(extra) * self.block_size
        self._num_hashed[seq.seq_id] = min(self._num_hashed.get(seq.seq_id, 0), num_blocks)

    def take_block(self) -> int | None:
        """One block held outside any sequence (a prefix snapshot's copy of a partial block),
        or None when none is free."""
        return self._pop_free() if self._free else None

    def release_block(self, block_id: int) -> None:
        self._unref(block_id)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self._free[block_id] = None

    def register_computed(self, seq: Sequence) -> None:
        """Index the full blocks whose KV has been computed, for later prefix reuse."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = self._num_hashed.get(seq.seq_id, 0)
        end = seq.num_computed_tokens // bs
        if end <= start:
            return
        tokens = seq.cache_ids
        prev_hash = self.blocks[seq.block_table[start - 1]].block_hash if start else None
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((prev_hash, chunk))
            if block.block_hash is None:
                block.block_hash = h
                block.token_ids = chunk
                self._by_hash.setdefault(h, block.block_id)
            prev_hash = block.block_hash
        self._num_hashed[seq.seq_id] = end

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; cached contents stay reusable until reallocated."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table.clear()
        self._num_hashed.pop(seq.seq_id, None)
