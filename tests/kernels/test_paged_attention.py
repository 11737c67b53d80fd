"""Paged attention: the naive kernels against a dense reference, the Triton ones against naive."""

from __future__ import annotations

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels import paged_attention as pa
from helexa.kernels.paged_attention import (
    decode_num_splits,
    naive_paged_decode_attention,
    naive_paged_prefill_attention,
    triton_paged_decode_attention,
    triton_paged_prefill_attention,
)

from . import DEVICE, max_rel_error, needs_triton

# Triton against naive: both accumulate in fp32 (fp32: a different summation order only);
# 16-bit: Triton rounds the probabilities to q's dtype before the PV product, as
# flash-attention does, and the interpreter truncates where torch rounds
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


# ---------------------------------------------------------------------------------------------
# inputs


class Paged:
    """A KV cache of whole blocks in a random (non-contiguous) order, and each sequence's block
    table into it, padded with block 0."""

    def __init__(
        self,
        context_lens: list[int],
        *,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 60,
        block_size: int = 16,
        max_blocks: int | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.num_heads, self.head_dim = block_size, num_heads, head_dim
        need = [-(-n // block_size) for n in context_lens]
        max_blocks = max_blocks or max(1, *need)
        num_blocks = sum(need) + 2  # block 0 only pads the tables, and one is spare
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
        self.v_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
        for row, n in enumerate(need):
            self.block_tables[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        self.block_tables = self.block_tables.to(DEVICE)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
        self.gen, self.dtype = gen, dtype
        self.scale = head_dim**-0.5

    def queries(self, num_tokens: int) -> torch.Tensor:
        q = torch.randn(num_tokens, self.num_heads, self.head_dim, generator=self.gen)
        return q.to(DEVICE, self.dtype)

    def decode_args(self, q: torch.Tensor) -> tuple:
        return q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def prefill_args(self, chunk_lens: list[int]) -> tuple:
        cu = torch.tensor([0, *torch.tensor(chunk_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = self.queries(sum(chunk_lens))
        return (
            q, self.k_cache, self.v_cache, cu.to(DEVICE), self.context_lens, self.block_tables,
            self.scale, max(chunk_lens),
        )  # fmt: skip


def dense_attention(q, keys, values, q_pos, scale) -> torch.Tensor:
    """q [L, H, D] at positions q_pos [L] over contiguous keys, values [S, KVH, D] (key j at
    position j), kv heads repeated, in float64 with an explicit mask -> [L, H, D] float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, L, S]
    allowed = torch.arange(keys.shape[0])[None, :] <= torch.as_tensor(q_pos)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, one slot at a time: [length, KVH, D]."""
    block_size = cache.shape[1]
    flat = cache.cpu().reshape(-1, *cache.shape[2:])
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(length)]
    return flat[slots]


def dense_decode(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, n in enumerate(context_lens.tolist()):
        if n:
            keys, values = (gather(c, block_tables[row], n) for c in (k_cache, v_cache))
            out[row] = dense_attention(q[row : row + 1].cpu(), keys, values, [n - 1], scale)[0]
    return out.to(q.device)


def dense_prefill(q, k_cache, v_cache, cu, context_lens, block_tables, scale, _max):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(context_lens.tolist()):
        start, end = int(cu[b]), int(cu[b + 1])
        keys, values = (gather(c, block_tables[b], n) for c in (k_cache, v_cache))
        q_pos = torch.arange(n - (end - start), n)
        out[start:end] = dense_attention(q[start:end].cpu(), keys, values, q_pos, scale)
    return out.to(q.device)


# ---------------------------------------------------------------------------------------------
# naive against the dense reference


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_naive_decode_matches_dense_attention(block_size, num_heads, num_kv_heads):
    paged = Paged(
        [1, 37, 0, 70], num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    args = paged.decode_args(paged.queries(4))
    out = naive_paged_decode_attention(*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert max_rel_error(out, dense_decode(*args)) < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no context: zeros, not NaN


@pytest.mark.parametrize("block_size", [1, 16])
def test_naive_prefill_matches_dense_attention_with_cached_prefixes(block_size):
    # a fresh prompt, a chunk after a cached prefix of several blocks, a one-token chunk
    paged = Paged([23, 70, 41], num_heads=8, num_kv_heads=2, block_size=block_size)
    args = paged.prefill_args([23, 19, 1])
    out = naive_paged_prefill_attention(*args)
    assert out.shape == args[0].shape
    assert max_rel_error(out, dense_prefill(*args)) < 1e-5


def test_naive_decode_is_the_last_row_of_a_prefill():
    paged = Paged([45, 9], block_size=8)
    args = paged.prefill_args([45, 9])
    q, cu = args[0], args[3]
    prefill = naive_paged_prefill_attention(*args)
    last = cu[1:].long() - 1
    decode = naive_paged_decode_attention(*paged.decode_args(q[last]))
    torch.testing.assert_close(decode, prefill[last])


def test_naive_keeps_16_bit_dtypes():
    paged = Paged([5, 12], dtype=torch.bfloat16)
    assert naive_paged_decode_attention(*paged.decode_args(paged.queries(2))).dtype == (
        torch.bfloat16
    )
    assert naive_paged_prefill_attention(*paged.prefill_args([5, 12])).dtype == torch.bfloat16


def test_mismatched_heads_are_refused():
    paged = Paged([5], num_heads=4, num_kv_heads=2)
    q = torch.zeros(1, 3, 60, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        naive_paged_decode_attention(*paged.decode_args(q))


# ---------------------------------------------------------------------------------------------
# Triton against naive: decode


def check_decode(paged: Paged, q: torch.Tensor) -> torch.Tensor:
    args = paged.decode_args(q)
    out = triton_paged_decode_attention(*args)
    want = naive_paged_decode_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_rel_error(out, want) < RTOL[q.dtype]
    return out


@needs_triton
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
def test_triton_decode_matches_naive_at_every_block_size(block_size):
    paged = Paged([1, 70, 33, 130], block_size=block_size)
    check_decode(paged, paged.queries(4))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_decode_matches_naive_in_each_dtype(dtype):
    paged = Paged([17, 100, 64], head_dim=128, dtype=dtype)
    check_decode(paged, paged.queries(3))


@needs_triton
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (16, 2), (8, 1), (6, 2)]
)  # groups 1, 2, 4, 8, MQA, and 3 (padded to the tile)
def test_triton_decode_matches_naive_for_each_gqa_group(num_heads, num_kv_heads):
    paged = Paged([9, 80], num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16)
    check_decode(paged, paged.queries(2))


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 128, 256, 60, 96])
def test_triton_decode_matches_naive_for_each_head_dim(head_dim):
    paged = Paged([3, 75], head_dim=head_dim)
    check_decode(paged, paged.queries(2))


@needs_triton
def test_triton_decode_reads_a_strided_query_and_zeroes_padding_rows():
    # a CUDA-graph batch: rows 1 and 3 are padding (no context); block 0, which padding
    # entries of the tables name, holds NaN, which no row may read
    paged = Paged([40, 0, 25, 0], block_size=8, max_blocks=8)
    paged.k_cache[0] = float("nan")
    paged.v_cache[0] = float("nan")
    qkv = paged.queries(4).repeat(1, 3, 1)  # q is the first third of a wider projection
    q = qkv[:, : paged.num_heads]
    out = check_decode(paged, q)
    assert not out.isnan().any()
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


def test_split_count_follows_shapes_only():
    assert decode_num_splits(4096) == 16  # a split per 256 tokens of the longest context
    assert decode_num_splits(32768) == pa.MAX_SPLITS
    assert decode_num_splits(128) == 1  # too short to split


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rows_output_does_not_depend_on_the_rows_beside_it(dtype):
    """Bit for bit: a row alone, in a batch of other lengths (a wider grid of splits), and
    as one of a sequence's speculative check rows (each a token longer) gives the same
    output: its split count comes from its own length."""
    lens = [700, 701, 702, 703, 40, 1500, 1]
    paged = Paged(lens, num_heads=8, num_kv_heads=2, block_size=32, max_blocks=48, dtype=dtype)
    q = paged.queries(len(lens))
    args = paged.decode_args(q)
    together = pa.triton_paged_decode_attention(*args)
    k, v, tables, context = args[1], args[2], args[3], args[4]
    for i in range(len(lens)):
        width = -(-lens[i] // 32)  # the row's own table: a narrower grid than the batch's
        alone = pa.triton_paged_decode_attention(
            q[i : i + 1], k, v, tables[i : i + 1, :width].contiguous(), context[i : i + 1],
            args[5],
        )  # fmt: skip
        assert torch.equal(together[i], alone[0]), i


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_splits_a_long_context_of_one_row(dtype):
    # one row, one kv head, tables of 1024 tokens: the context is split (flash-decoding)
    paged = Paged([900], num_heads=4, num_kv_heads=1, block_size=32, max_blocks=32, dtype=dtype)
    assert decode_num_splits(1024) == 4
    check_decode(paged, paged.queries(1))


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_triton_decode_with_forced_splits_some_of_them_empty(num_splits):
    # rows of 0, 1, 64 and 200 tokens: with 64-token tiles most splits of the short rows are
    # empty, and the merge must weigh them 0 (or give zeros where every split is empty)
    paged = Paged([0, 1, 64, 200], block_size=16)
    q = paged.queries(4)
    args = paged.decode_args(q)
    out = torch.empty_like(q)
    pa._launch_paged_decode(*args, out, num_splits)
    assert max_rel_error(out, naive_paged_decode_attention(*args)) < RTOL[torch.float32]
    assert torch.equal(out[0], torch.zeros_like(out[0]))


# ---------------------------------------------------------------------------------------------
# Triton against naive: prefill


def check_prefill(paged: Paged, chunk_lens: list[int]) -> None:
    args = paged.prefill_args(chunk_lens)
    out = triton_paged_prefill_attention(*args)
    want = naive_paged_prefill_attention(*args)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert max_rel_error(out, want) < RTOL[paged.dtype]


@needs_triton
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
def test_triton_prefill_matches_naive_at_every_block_size(block_size):
    # a fresh prompt, a chunk after a cached prefix of several blocks, a one-token chunk
    paged = Paged([23, 70, 41], block_size=block_size)
    check_prefill(paged, [23, 19, 1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_prefill_matches_naive_in_each_dtype(dtype):
    paged = Paged([30, 50], head_dim=128, dtype=dtype)
    check_prefill(paged, [30, 20])


@needs_triton
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2), (8, 1), (6, 2)]
)  # groups 1, 2, 4, MQA of 8, and 3
def test_triton_prefill_matches_naive_for_each_gqa_group(num_heads, num_kv_heads):
    paged = Paged([20, 45], num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16)
    check_prefill(paged, [20, 13])


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 128, 256, 60, 96])
def test_triton_prefill_matches_naive_for_each_head_dim(head_dim):
    paged = Paged([24, 40], num_heads=2, num_kv_heads=1, head_dim=head_dim)
    check_prefill(paged, [24, 9])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_of_long_chunks_after_a_long_prefix(dtype):
    # several query blocks per sequence, whole key tiles before each block's diagonal (taken
    # unmasked), a chunk that starts mid-block, and an empty sequence in the batch
    paged = Paged([150, 0, 220, 130], num_heads=2, num_kv_heads=1, block_size=16, dtype=dtype)
    check_prefill(paged, [150, 0, 93, 1])


@needs_triton
def test_triton_prefill_with_small_tiles_crosses_many_tiles_and_blocks(monkeypatch):
    # 16 x 16 tiles over blocks of 8: many query blocks and key tiles per sequence
    monkeypatch.setattr(pa, "_prefill_config", lambda *_: (16, 16, 4, 1))
    paged = Paged([61, 77], num_heads=4, num_kv_heads=2, block_size=8)
    check_prefill(paged, [61, 35])


# ---------------------------------------------------------------------------------------------
# the dispatcher


def test_dispatcher_runs_naive_on_cpu_by_default():
    paged = Paged([7, 30])
    q = paged.queries(2).cpu()
    args = (q, *(t.cpu() for t in paged.decode_args(q)[1:5]), paged.scale)
    torch.testing.assert_close(
        kernels.paged_decode_attention(*args), naive_paged_decode_attention(*args)
    )


@needs_triton
def test_dispatcher_runs_triton_when_asked():
    kernels.set_backend("triton")
    paged = Paged([7, 30])
    decode = paged.decode_args(paged.queries(2))
    got, want = kernels.paged_decode_attention(*decode), naive_paged_decode_attention(*decode)
    assert max_rel_error(got, want) < RTOL[torch.float32]
    prefill = paged.prefill_args([7, 12])
    got, want = kernels.paged_prefill_attention(*prefill), naive_paged_prefill_attention(*prefill)
    assert max_rel_error(got, want) < RTOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# on a GPU, at a real model's shapes (Qwen3-8B: 32 query heads, 8 kv heads, D = 128)


def random_paged(context_lens: list[int], block_size: int = 16) -> Paged:
    return Paged(
        context_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size,
        max_blocks=4096 // block_size, dtype=torch.bfloat16,
    )  # fmt: skip


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_gpu_decode_at_qwen3_8b_shapes(num_seqs):
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 4097, (num_seqs,), generator=gen).tolist()
    lens[0] = 4096
    paged = random_paged(lens)
    check_decode(paged, paged.queries(num_seqs))


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_prefill_at_qwen3_8b_shapes():
    # a chunk after a cached 3000, a fresh prompt of 512, one token after 4095, a whole 4096
    paged = random_paged([4000, 512, 4096, 4096])
    check_prefill(paged, [1000, 512, 1, 4096])


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_decode_replays_in_a_cuda_graph_with_new_lengths():
    paged = random_paged([4096, 1000, 17, 0])
    q = paged.queries(4)
    args = paged.decode_args(q)
    triton_paged_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged_decode_attention(*args)
    for lens in ([4096, 1000, 17, 0], [3, 0, 2000, 4096]):
        paged.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(paged.queries(4))
        graph.replay()
        assert max_rel_error(out, naive_paged_decode_attention(*args)) < 2e-2
