"""A mixture-of-experts layer's experts (SwiGLU MLPs), each token through its top-k of them.

out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j],
where w13[e] holds gate rows 0..I-1 then up rows I..2I-1 (HF's gate_up_proj layout).

The Triton path (after vLLM's fused_moe): the T*k (token, slot) pairs are sorted by expert
and each expert's run padded to whole blocks of BLOCK_M rows (`align_by_expert`, in torch,
with no host sync); then two grouped GEMMs over those blocks, each block one expert's weights:
h[pair] = silu(x @ gate.T) * (x @ up.T), then y[pair] = weight[pair] * (h @ w2.T) in fp32, and
out = the sum of y over each token's k slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def moe_by_expert(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each expert run once, on exactly the tokens routed to it, then mixed.

    x: [T, H]; topk_weights: [T, k] float; topk_ids: [T, k] int; expert(e, rows [n, H]) ->
    [n, H]. Returns [T, H] in x.dtype; the weighted sum over k is accumulated in fp32.
    """
    num_tokens, top_k = topk_ids.shape
    # (token, slot) pairs sorted by expert: each expert's pairs are one contiguous run
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        y = expert(e, x[rows])
        out.index_add_(0, rows, y.float() * weight_of[start : start + count, None])
        start += count
    return out.to(x.dtype)


def naive_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts in plain torch, each run only on the tokens routed to it.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [T, k] float; topk_ids: [T, k]
    int. Returns [T, H] in x.dtype; the weighted sum over k is accumulated in fp32.
    """
    inter = w13.shape[1] // 2

    def swiglu(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = rows @ w13[e].T  # [n, 2I]
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        return h.to(x.dtype) @ w2[e].T  # [n, H]

    return moe_by_expert(x, topk_weights, topk_ids, w13.shape[0], swiglu)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert in blocks of block_m rows, without a host sync.

    topk_ids: [T, k]. Returns sorted_pairs [num_blocks * block_m] int32 (pair p = t*k + j;
    padding rows hold T*k) and block_expert [num_blocks] int32 (-1: a block past the end). The
    grid is sized for the worst case: at most min(E, T*k) experts each leave < block_m padding.
    """
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first_pair = counts.cumsum(0) - counts  # where each expert's run starts, unpadded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = padded_end[expert] - padded[expert] + torch.arange(num_pairs, device=device)
    dest -= first_pair[expert]
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-max_rows // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


if triton is not None:

    @triton.jit
    def _moe_gate_up_kernel(
        x_ptr, w13_ptr, h_ptr, sorted_pairs_ptr, block_expert_ptr,
        num_pairs, hidden, inter,
        stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hp, stride_hi,
        TOP_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """h[pair, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for one block of one
        expert's pairs and BLOCK_N of the I columns."""
        expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
        row_ok = pair < num_pairs
        token = pair // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
        # gate_e.T and up_e.T tiles: [BLOCK_K, BLOCK_N]
        gate_ptrs = (
            w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
        )
        up_ptrs = gate_ptrs + inter * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k0
            xb = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            if UPCAST:
                xb, gate, up = xb.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = tl.dot(xb, gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(xb, up, acc_up, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xh
            gate_ptrs += BLOCK_K * stride_wh
            up_ptrs += BLOCK_K * stride_wh
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(
            h_ptr + pair[:, None] * stride_hp + offs_n[None, :] * stride_hi,
            h.to(h_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    @triton.jit
    def _moe_down_kernel(
        h_ptr, w2_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
        num_pairs, hidden, inter,
        stride_hp, stride_hi, stride_we, stride_wn, stride_wi, stride_yp, stride_yh,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[pair, n] = weight[pair] * (h[pair] . w2_e[n]) in fp32 for one block of one expert's
        pairs and BLOCK_N of the H columns."""
        expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
        row_ok = pair < num_pairs
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hidden
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + pair[:, None] * stride_hp + offs_k[None, :] * stride_hi
        # w2_e.T tile: [BLOCK_K, BLOCK_N]
        w_ptrs = (
            w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = offs_k < inter - k0
            hb = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                hb, w = hb.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(hb, w, acc, input_precision=PRECISION)
            h_ptrs += BLOCK_K * stride_hi
            w_ptrs += BLOCK_K * stride_wi
        weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(
            y_ptr + pair[:, None] * stride_yp + offs_n[None, :] * stride_yh,
            acc * weight[:, None],
            mask=row_ok[:, None] & col_ok[None, :],
        )


def _block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks when experts see few tokens each (decode),
    as vLLM's default configs do; 16 is tl.dot's least size."""
    if num_pairs <= 4 * num_experts:
        return 16, 64, 64
    return 64, 64, 32


def _launch_fused_moe(x, w13, w2, weights, topk_ids, h, y) -> None:
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    block_m, block_n, block_k = _block_sizes(num_pairs, num_experts)
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    # fp32 inputs: full-precision dots, not tf32, so that fp32 matches torch to ~1e-6
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Triton's interpreter (CPU) multiplies 16-bit float operands as their raw bits (3.9's
    # create_dot), so there they are upcast to fp32 first; compiled kernels dot them as they are
    upcast = x.device.type == "cpu" and x.dtype != torch.float32
    num_blocks = block_expert.shape[0]
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_pairs, block_expert,
        num_pairs, hidden, inter,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        h.stride(0), h.stride(1),
        TOP_K=top_k, PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, y, weights, sorted_pairs, block_expert,
        num_pairs, hidden, inter,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        y.stride(0), y.stride(1),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def triton_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """As naive_fused_moe, in Triton: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (same dtype as
    x); topk_weights [T, k] float; topk_ids [T, k] int -> [T, H] in x.dtype.

    The intermediate h [T*k, I] is kept in x.dtype (as the naive path does); each slot's
    output is fp32 and the k slots are summed in fp32.
    """
    if triton is None:
        raise RuntimeError(
            "triton_fused_moe needs triton, which is not installed; use naive_fused_moe"
        )
    num_tokens, top_k = topk_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _launch_fused_moe(x, w13, w2, weights, topk_ids, h, y)
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
