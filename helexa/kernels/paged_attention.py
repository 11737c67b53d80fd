"""Softmax attention over the paged KV cache: decode steps, and prefill (chunked prefill too).

The cache of one layer is k_cache, v_cache [num_blocks, block_size, KVH, D] (block_size a power
of two); token p of a sequence sits in block block_table[p // block_size] at row
p % block_size. Query head h reads kv head h // (H // KVH) (GQA; KVH = 1 is MQA).

Two entry points, each as `naive_*` (plain torch, fp32) and `triton_*`:
- `*_paged_decode_attention`: one query token per sequence, attending to its whole context;
- `*_paged_prefill_attention`: a varlen batch of new chunks, each query attending causally to
  its sequence's cached prefix and to the chunk up to itself.

The Triton kernels (after flash-attention 2 and flash-decoding) keep an online softmax in fp32
in the log2 domain. Decode runs one program per (sequence, kv head) holding that kv head's whole
group of query heads, so each K/V tile is read once per group; when those programs are too few
to fill the GPU, the context is also split among several programs whose partial results a small
kernel merges. Each row splits its context by its own length (a split per 256 tokens, up to
32), so a row's output does not depend on the rows beside it; the grid's split count comes
from tensor shapes alone, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(group, block_size) after checking that q and the caches fit together."""
    num_heads, head_dim = q.shape[-2:]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            f"[num_blocks, block_size, KVH, {head_dim}]"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype} differ")
    return num_heads // num_kv_heads, block_size


def naive_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step of N sequences, in plain torch (fp32), without host syncs.

    q: [N, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D], q's dtype; block_tables:
    [N, max_blocks] int32 (entries past a sequence's blocks: any valid block id);
    context_lens: [N] int32, the tokens each row attends to, its own included. Returns o
    [N, H, D] in q.dtype; a row with context_len 0 gets zeros.
    """
    group, block_size = _check(q, k_cache, v_cache)
    num_seqs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = block_tables.shape[1] * block_size
    # every block a row's table names, in order: [N, KVH, D, max_len] and [N, KVH, max_len, D]
    k = k_cache[block_tables.long()].reshape(num_seqs, max_len, num_kv_heads, head_dim)
    v = v_cache[block_tables.long()].reshape(num_seqs, max_len, num_kv_heads, head_dim)
    k, v = k.permute(0, 2, 3, 1).float(), v.transpose(1, 2).float()
    qg = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ k) * scale  # [N, KVH, G, max_len]
    seen = torch.arange(max_len, device=q.device) < context_lens[:, None]  # [N, max_len]
    seen = seen[:, None, None, :]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    probs = torch.where(seen, probs, 0.0)  # an empty row's softmax is NaN: make it zeros
    v = v.masked_fill(~seen.transpose(2, 3), 0.0)  # blocks past the context may hold NaN
    return (probs @ v).reshape(q.shape).to(q.dtype)


def naive_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
) -> torch.Tensor:
    """New chunks of B sequences attending causally over the paged cache, in plain torch (fp32).

    q: [T, H, D], the sequences' new tokens end to end; k_cache, v_cache: [num_blocks,
    block_size, KVH, D], q's dtype, already holding every token's K/V, the new ones included;
    cu_seqlens_q: [B+1] int32, sequence b's rows are cu_seqlens_q[b]:cu_seqlens_q[b+1];
    context_lens: [B] int32, each sequence's tokens after this chunk (cached prefix + chunk);
    block_tables: [B, max_blocks] int32; max_seqlen_q: the longest chunk (unused here). Query i
    of a chunk of L sits at position context_len - L + i and sees positions 0 up to it.
    Returns o [T, H, D] in q.dtype (T = cu_seqlens_q[-1]).
    """
    group, block_size = _check(q, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    starts = cu_seqlens_q.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pos = torch.arange(context_len, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().permute(1, 2, 0)  # [KVH, D, ctx]
        v = v_cache[blocks, pos % block_size].float().transpose(0, 1)  # [KVH, ctx, D]
        qb = q[start:end].float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = (qb @ k[:, None]) * scale  # [KVH, G, L, ctx]
        q_pos = context_len - q_len + torch.arange(q_len, device=q.device)
        seen = pos[None, :] <= q_pos[:, None]  # [L, ctx]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        o = probs @ v[:, None]  # [KVH, G, L, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, -1, head_dim).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Triton. Scores are kept as s * scale * log2(e), so that exp2 serves for exp. The running max
# starts at a finite -1e30, not -inf, so that a tile whose keys are all masked leaves the
# state as it was (exp2(-1e30 - m) = 0, never NaN).

MIN_SPLIT_TOKENS = 256  # a split-KV program's share of its row: a split per this many tokens
MAX_SPLITS = 32
SMEM_BUDGET = 160 * 1024  # of an H100's 227 KB a block may use, leaving room for the compiler

if triton is not None:
    M_INIT = tl.constexpr(-1.0e30)

    @triton.jit
    def _attend_tile(
        acc, m_i, l_i, q, block_table, k_head, v_head, start_n, context_len, q_pos, qk_scale,
        stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        offs_n, offs_d, d_ok,
        BLOCK_SIZE: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Fold the keys start_n + offs_n into one online softmax: q [M, BLOCK_D] against the
        K/V rows the block table maps them to. BOUNDED: keys at or past context_len are left
        out (not even read); CAUSAL: so are keys after each query's q_pos [M]."""
        pos = start_n + offs_n
        if BOUNDED:
            key_ok = pos < context_len
            block = tl.load(block_table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        else:
            block = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
        row = pos % BLOCK_SIZE
        # K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D], one gathered cache row per key
        k_ptrs = (
            k_head + block[None, :] * stride_kb + row[None, :] * stride_kt
            + offs_d[:, None] * stride_kd
        )  # fmt: skip
        v_ptrs = (
            v_head + block[:, None] * stride_vb + row[:, None] * stride_vt
            + offs_d[None, :] * stride_vd
        )  # fmt: skip
        if BOUNDED:
            k = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [M, BLOCK_N]
        if CAUSAL:
            s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
        elif BOUNDED:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # 16-bit P for a 16-bit tensor-core dot, as flash-attention does
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        o_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        qk_scale, num_splits,
        stride_qn, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_btn, stride_on, stride_oh, stride_od,
        stride_pn, stride_ph, stride_ps,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
    ):  # fmt: skip
        """Grid (N, KVH, splits): the GROUP query heads of one kv head of one row against one
        split of its context: the row's tiles dealt out in contiguous runs, one per split of
        the row's own (a MIN_SPLIT-token share each, at most `num_splits`; the splits past
        them are empty). SPLIT: write the unnormalised partial (acc, m, l); else the output
        itself (what the merge gives a row of one split, to the bit)."""
        n = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + n)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        q = tl.load(
            q_ptr + n * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # the row's own split count, from its length alone (never the batch's): a row's
        # floats do not depend on the rows beside it (see decode_num_splits)
        row_splits = tl.maximum(1, tl.minimum(context_len // MIN_SPLIT, num_splits))
        tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), row_splits)
        lo = split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, context_len)
        m_i = tl.full([BLOCK_G], M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        block_table = block_tables_ptr + n.to(tl.int64) * stride_btn
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, block_table, k_head, v_head, start_n, context_len, offs_g,
                qk_scale, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                offs_n, offs_d, d_ok,
                BLOCK_SIZE=BLOCK_SIZE, BOUNDED=True, CAUSAL=False,
                PRECISION=PRECISION, UPCAST=UPCAST,
            )  # fmt: skip
        if SPLIT:
            part = n * stride_pn + heads * stride_ph + split * stride_ps  # [BLOCK_G]
            tl.store(part_m_ptr + part, m_i, mask=g_ok)
            tl.store(part_l_ptr + part, l_i, mask=g_ok)
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                acc,
                mask=g_ok[:, None] & d_ok[None, :],
            )
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context: zeros
            tl.store(
                o_ptr + n * stride_on + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                out.to(o_ptr.dtype.element_ty),
                mask=g_ok[:, None] & d_ok[None, :],
            )

    @triton.jit
    def _paged_decode_reduce_kernel(
        part_acc_ptr, part_m_ptr, part_l_ptr, o_ptr,
        num_splits,
        stride_pn, stride_ph, stride_on, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Grid (N, H): merge one head's split partials, each rescaled to the largest max."""
        n = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        d_ok = offs_d < HEAD_DIM
        part = n * stride_pn + head * stride_ph + offs_s  # the splits are contiguous
        m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
        l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)  # noqa: E741
        acc = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        w = tl.exp2(m - tl.max(m, 0))  # empty splits hold M_INIT: weight 0 beside a real one
        denom = tl.sum(w * l, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(
            o_ptr + n * stride_on + head * stride_oh + offs_d * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=d_ok,
        )

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
        o_ptr,
        qk_scale,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_btb, stride_ot, stride_oh, stride_od,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Grid (query blocks, H, B): BLOCK_M of sequence b's new queries, one head, against
        the keys up to the block's last query; the blocks nearest the end go first, as they
        have the most keys."""
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
        b = tl.program_id(2)
        q_start = tl.load(cu_seqlens_ptr + b)
        q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
        if m_block * BLOCK_M >= q_len:
            return
        context_len = tl.load(context_lens_ptr + b)
        prefix = context_len - q_len
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        d_ok = offs_d < HEAD_DIM
        q_pos = prefix + offs_m
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        block_table = block_tables_ptr + b.to(tl.int64) * stride_btb
        kv_head = head // GROUP
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        # whole tiles before the block's first query position: every query sees every key
        full_end = (prefix + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, block_table, k_head, v_head, start_n, context_len, q_pos,
                qk_scale, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                offs_n, offs_d, d_ok,
                BLOCK_SIZE=BLOCK_SIZE, BOUNDED=False, CAUSAL=False,
                PRECISION=PRECISION, UPCAST=UPCAST,
            )  # fmt: skip
        # then the diagonal, up to the block's last query; tiles above it are never visited
        end = tl.minimum(prefix + (m_block + 1) * BLOCK_M, context_len)
        for start_n in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, block_table, k_head, v_head, start_n, context_len, q_pos,
                qk_scale, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                offs_n, offs_d, d_ok,
                BLOCK_SIZE=BLOCK_SIZE, BOUNDED=True, CAUSAL=True,
                PRECISION=PRECISION, UPCAST=UPCAST,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


def _require_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton, which is not installed; use naive_{name[7:]}")


def _block_d(head_dim: int) -> int:
    """head_dim padded to a power of two (masked), at least tl.dot's least size 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _dot_modes(x: torch.Tensor) -> tuple[str, bool]:
    """(PRECISION, UPCAST). fp32: full-precision dots, not tf32, to match torch to ~1e-6.
    Triton 3.9's interpreter (CPU) multiplies 16-bit float operands as their raw bits, so there
    they are upcast to fp32 first; compiled kernels dot them as they are."""
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    return precision, x.device.type == "cpu" and x.dtype != torch.float32


def decode_num_splits(max_context: int) -> int:
    """The grid's splits of each (row, kv head)'s context: as many as the longest possible
    context (max_context, from the block table's width) has MIN_SPLIT_TOKENS shares, at most
    MAX_SPLITS. Each row then takes its own count from its own length (one per share, the
    same bound), and the splits past it are empty: so a row's floats never depend on the
    batch beside it, and a speculative check row (several rows of one sequence, each a token
    longer) computes what its one-row decode step would. When the count followed the batch
    (enough programs to fill the SMs: one row took 16 splits, 64 rows one), a row's sums
    changed with its neighbours, and a bf16 near tie could part greedy answers. Shapes only:
    the same answer for every step a CUDA graph replays."""
    return max(1, min(max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _num_stages(rows: int, block_n: int, block_d: int, elem_size: int) -> int:
    """Software-pipeline depth: up to 3 stages of a K and a V tile in shared memory, beside the
    query tile, within SMEM_BUDGET."""
    per_stage = 2 * block_n * block_d * elem_size
    return max(1, min(3, (SMEM_BUDGET - rows * block_d * elem_size) // per_stage))


def _decode_config(head_dim: int, block_g: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): decode streams K/V from memory, 64 tokens a tile
    (a K and a V tile of 16 KB each in bf16 at D = 128), 32 at D = 256."""
    block_d = _block_d(head_dim)
    block_n = 64 if block_d <= 128 else 32
    return block_n, 4, _num_stages(block_g, block_n, block_d, elem_size)


def _prefill_config(head_dim: int, max_seqlen_q: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 64 x 64 tiles (fewer query rows for short
    chunks, down to 16); D = 256 halves BLOCK_N and doubles the warps to hold the accumulator."""
    block_d = _block_d(head_dim)
    block_m = min(64, max(16, triton.next_power_of_2(max(1, max_seqlen_q))))
    block_n, num_warps = (64, 4) if block_d <= 128 else (32, 8)
    return block_m, block_n, num_warps, _num_stages(block_m, block_n, block_d, elem_size)


def _launch_paged_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits: int
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot's least M is 16
    block_n, num_warps, num_stages = _decode_config(head_dim, block_g, q.element_size())
    block_d = _block_d(head_dim)
    precision, upcast = _dot_modes(q)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # placeholders, never touched
        part_acc = part_m = part_l = out
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_m, part_l,
        scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
        num_heads * num_splits, num_splits, 1,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=split, PRECISION=precision, UPCAST=upcast, MIN_SPLIT=MIN_SPLIT_TOKENS,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out,
            num_splits,
            num_heads * num_splits, num_splits, out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4 if block_d >= 128 else 2,
        )  # fmt: skip


def triton_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As naive_paged_decode_attention, in Triton: q [N, H, D]; k_cache, v_cache [num_blocks,
    block_size, KVH, D]; block_tables [N, max_blocks] int32; context_lens [N] int32 -> o
    [N, H, D] in q.dtype (zeros where context_len is 0).

    CUDA-graph safe: reads no tensor on the host; the grid and the split count follow from
    the shapes (the longest context is block_tables.shape[1] * block_size).
    """
    _require_triton("triton_paged_decode_attention")
    _, block_size = _check(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    num_splits = decode_num_splits(max_context)
    _launch_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits)
    return out


def _launch_paged_prefill(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q, out
) -> None:
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    block_m, block_n, num_warps, num_stages = _prefill_config(
        head_dim, max_seqlen_q, q.element_size()
    )
    precision, upcast = _dot_modes(q)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim),
        PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def triton_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
) -> torch.Tensor:
    """As naive_paged_prefill_attention, in Triton (flash-attention 2 over the paged cache):
    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; cu_seqlens_q [B+1] int32;
    context_lens [B] int32; block_tables [B, max_blocks] int32; max_seqlen_q, a host int at
    least the longest chunk, sizes the grid -> o [T, H, D] in q.dtype (T = cu_seqlens_q[-1];
    rows past it are not written)."""
    _require_triton("triton_paged_prefill_attention")
    _check(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] < 2 or max_seqlen_q <= 0:
        return out
    _launch_paged_prefill(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q, out
    )
    return out
