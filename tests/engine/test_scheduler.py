"""Scheduler and block manager books, without tensors."""

from __future__ import annotations

import pytest

from helexa.engine.block_manager import BlockManager
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.scheduler import Scheduler, SchedulerConfig
from helexa.engine.sequence import Sequence, SequenceStatus
from helexa.engine.tokenizer import Tokenizer


class _NoTokenizer(Tokenizer):
    def __init__(self) -> None:  # decode is all a Sequence needs here
        self.eos_token_ids = {0}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def seq(n: int, max_tokens: int = 8, start: int = 1) -> Sequence:
    return Sequence(
        list(range(start, start + n)), SamplingParams(), _NoTokenizer(), max_tokens=max_tokens
    )


def run_step(sched: Scheduler, token: int = 7):
    batch = sched.schedule()
    sampled = [token if batch.samples(i) else None for i in range(len(batch.seqs))]
    sched.postprocess(batch, sampled)
    return batch


def test_a_long_prompt_prefills_in_chunks_while_others_keep_decoding():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=8), bm)
    short = seq(3)
    sched.add(short)
    run_step(sched)  # short is prefilled and has its first token
    long = seq(40, start=100)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_tokens - 1 or long.num_output_tokens == 0:
        batch = run_step(sched)
        assert short in batch.seqs or short.is_finished, "decode stalled behind a prefill"
        chunks.append(batch.num_new_tokens[batch.seqs.index(long)])
        if short.is_finished:
            break
    assert max(chunks) <= 8 and len(chunks) >= 3


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_requeued_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    old, new = seq(7, max_tokens=20), seq(7, max_tokens=20, start=50)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # 2 blocks each: the pool is full
    assert bm.num_free_blocks == 0
    run_step(sched)  # KV for 8 tokens each still fits in 2 blocks
    assert sched.num_preemptions == 0
    run_step(sched)  # old needs a third block for its 9th token -> new is preempted
    assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and old.status is SequenceStatus.RUNNING


def test_finished_and_aborted_sequences_free_their_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    a, b = seq(5, max_tokens=1), seq(5, max_tokens=50, start=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.is_finished and a.finish_reason == "length"
    sched.abort(b.request_id)
    assert b.finish_reason == "abort"
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_work()


def test_a_repeated_prompt_prefix_reuses_cached_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    first = seq(10, max_tokens=1)
    sched.add(first)
    run_step(sched)
    again = seq(10, max_tokens=1)
    sched.add(again)
    batch = run_step(sched)
    assert again.num_cached_tokens == 8  # two full blocks; the last token is recomputed
    assert batch.num_new_tokens == [2]
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (20, 8)


def test_a_prompt_counts_what_it_read_from_the_cache_and_what_it_stored_there():
    """What prompt-cache pricing bills: of each prompt, the tokens read from the prefix
    cache and those of its full blocks computed and stored for later requests."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    first = seq(10, max_tokens=1)
    sched.add(first)
    run_step(sched)
    assert (first.num_cached_tokens, first.num_cache_written_tokens) == (0, 8)
    longer = seq(15, max_tokens=1)  # the first's 10 tokens, then 5 more
    sched.add(longer)
    run_step(sched)
    assert (longer.num_cached_tokens, longer.num_cache_written_tokens) == (8, 4)
    out = longer.to_output()
    assert (out.num_cached_tokens, out.num_cache_written_tokens) == (8, 4)
    off = Scheduler(SchedulerConfig(), BlockManager(16, 4, enable_prefix_caching=False))
    for s in (seq(10, max_tokens=1), seq(10, max_tokens=1)):
        off.add(s)
        run_step(off)
        assert (s.num_cached_tokens, s.num_cache_written_tokens) == (0, 0)


def test_a_cached_block_is_evicted_only_when_its_memory_is_needed():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    first = seq(9, max_tokens=1)
    sched.add(first)
    run_step(sched)
    other = seq(9, max_tokens=1, start=40)  # needs all three blocks: evicts the cache
    sched.add(other)
    run_step(sched)
    again = seq(9, max_tokens=1)
    sched.add(again)
    run_step(sched)
    assert again.num_cached_tokens == 0


def test_sampling_params_are_validated_with_the_name_and_value():
    # a lone surrogate (JSON lets "\ud800" through) can never match UTF-8 output, and
    # could not be sent to a model's worker process: a 400 naming `stop`, not a 500
    with pytest.raises(ValueError, match="stop must be valid Unicode"):
        SamplingParams(stop=["ok", "\ud800"])
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
