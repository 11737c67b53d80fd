"""fused_moe over quantized experts: the routed SwiGLU experts with their weights held as
QuantWeights (quant_pack's layouts), dequantized in registers, with no host sync.

Each of w13 and w2 is one QuantWeight of every expert's rows stacked (as GGUF stores
`ffn_*_exps`: pack_gguf of its [E * rows, in] bytes, or quant_pack.cat_rows of per-expert
weights): w13 [E * 2I, H], expert e's gate rows e*2I .. e*2I+I-1 then its up rows; w2
[E * H, I]. The two may be of different kinds (GGUF MoE files often hold Q4_K gate/up and Q6_K
down). The Triton path is triton_fused_moe's (pairs sorted by expert and padded to blocks by
align_by_expert; a gate/up grouped GEMM with SwiGLU, then a down GEMM weighted by the router)
with quant_matmul's decode (_codes, _affine) in place of plain weight loads.
"""

from __future__ import annotations

import torch

from .fused_moe import align_by_expert, naive_fused_moe
from .quant_matmul import DECODE as _DECODE
from .quant_matmul import GROUP, QuantWeight, _precision, check_shape, naive_dequantize

try:
    import triton
    import triton.language as tl

    from .quant_matmul import _affine, _codes
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def _check(x: torch.Tensor, w13: QuantWeight, w2: QuantWeight) -> tuple[int, int]:
    """(E, I): the experts and their intermediate size, after checking that the stacked
    shapes agree."""
    hidden = x.shape[1]
    inter = w2.in_features
    num_experts = max(1, w2.out_features // hidden)
    want13, want2 = (num_experts * 2 * inter, hidden), (num_experts * hidden, inter)
    got13, got2 = (w13.out_features, w13.in_features), (w2.out_features, w2.in_features)
    if got13 != want13 or got2 != want2:
        raise ValueError(
            f"{num_experts} experts of x [T, {hidden}] need w13 {want13} and w2 {want2}; got "
            f"{got13} and {got2}"
        )
    for qw in (w13, w2):
        if (reason := check_shape(qw.kind, (qw.out_features, qw.in_features))) is not None:
            raise ValueError(reason)
    return num_experts, inter


def naive_quant_fused_moe(
    x: torch.Tensor,
    w13: QuantWeight,
    w2: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts in plain torch, in fp32, from the dequantized weights: x [T, H]; w13 [E*2I,
    H] and w2 [E*H, I] stacked QuantWeights (E and I read from their shapes); topk_weights,
    topk_ids [T, k] -> [T, H] in x.dtype. Dequantizes every expert every call: a reference."""
    num_experts, inter = _check(x, w13, w2)
    hidden = x.shape[1]
    w13f = naive_dequantize(w13).view(num_experts, 2 * inter, hidden)
    w2f = naive_dequantize(w2).view(num_experts, hidden, inter)
    return naive_fused_moe(x.float(), w13f, w2f, topk_weights, topk_ids).to(x.dtype)


if triton is not None:

    @triton.jit
    def _expert_tile(
        qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, rows, n_ok, g, j, g_end,
        stride_qs, stride_qh, stride_s, stride_d,
        KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The dequantized [BLOCK_K/2, BLOCK_N] low and high half-group tiles of W rows `rows`
        ([1, 1, BLOCK_N] int64) at groups g ([groups, 1, 1]), positions j ([1, half, 1])."""
        mask = n_ok & (g < g_end)
        lo, hi = _codes(
            qs_ptr + rows * stride_qs, qh_ptr + rows * stride_qh, g, j, mask, KIND, GROUP
        )
        a, b = _affine(
            s_ptr + rows * stride_s, m_ptr + rows * stride_s, d_ptr + rows * stride_d,
            dmin_ptr + rows * stride_d, g, mask, KIND, GROUP,
        )  # fmt: skip
        lo = (lo * a + b).reshape(BLOCK_K // 2, BLOCK_N)
        hi = (hi * a + b).reshape(BLOCK_K // 2, BLOCK_N)
        return lo, hi

    @triton.jit
    def _channel_scale(acc, s_ptr, rows, mask, KIND: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] times int8's or fp8's per-row scale (x256 for fp8, whose
        codes are its values / 256) of W rows `rows` [BLOCK_N]; other kinds: acc."""
        if KIND == "int8" or KIND == "fp8":
            scale = tl.load(s_ptr + rows, mask=mask, other=0.0)
            if KIND == "fp8":
                scale = scale * 256.0
            acc = acc * scale[None, :]
        return acc

    @triton.jit
    def _quant_moe_gate_up_kernel(
        x_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, h_ptr,
        sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
        stride_xt, stride_qs, stride_qh, stride_s, stride_d, stride_hp,
        KIND: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """h[pair, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for one block of one
        expert's pairs and BLOCK_N of the I columns."""
        expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        HALF: tl.constexpr = GROUP // 2
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
        row_ok = pair < num_pairs
        x_rows = x_ptr + (pair // TOP_K)[:, None] * stride_xt
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < inter)[None, None, :]
        gate_rows = (expert * 2 * inter + offs_n)[None, None, :]  # int64
        up_rows = gate_rows + inter
        j = tl.arange(0, HALF)[None, :, None]
        t = tl.arange(0, BLOCK_K // 2)
        num_groups = hidden // GROUP
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g0 in range(0, num_groups, GROUPS):
            g = g0 + tl.arange(0, GROUPS)[:, None, None]
            gate_lo, gate_hi = _expert_tile(
                qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, gate_rows, n_ok, g, j, num_groups,
                stride_qs, stride_qh, stride_s, stride_d, KIND, GROUP, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            up_lo, up_hi = _expert_tile(
                qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, up_rows, n_ok, g, j, num_groups,
                stride_qs, stride_qh, stride_s, stride_d, KIND, GROUP, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            g_t = g0 + t // HALF
            k = (g_t * GROUP + t % HALF)[None, :]
            x_ok = row_ok[:, None] & (g_t < num_groups)[None, :]
            x_lo = tl.load(x_rows + k, mask=x_ok, other=0.0)
            x_hi = tl.load(x_rows + k + HALF, mask=x_ok, other=0.0)
            if UPCAST:  # Triton's interpreter dots 16-bit floats as raw bits (3.9)
                x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            else:
                dt = x_ptr.dtype.element_ty
                gate_lo, gate_hi = gate_lo.to(dt), gate_hi.to(dt)
                up_lo, up_hi = up_lo.to(dt), up_hi.to(dt)
            acc_gate = tl.dot(x_lo, gate_lo, acc_gate, input_precision=PRECISION)
            acc_gate = tl.dot(x_hi, gate_hi, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x_lo, up_lo, acc_up, input_precision=PRECISION)
            acc_up = tl.dot(x_hi, up_hi, acc_up, input_precision=PRECISION)
        acc_gate = _channel_scale(acc_gate, s_ptr, gate_rows.reshape(BLOCK_N), offs_n < inter, KIND)
        acc_up = _channel_scale(acc_up, s_ptr, up_rows.reshape(BLOCK_N), offs_n < inter, KIND)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(
            h_ptr + pair[:, None] * stride_hp + offs_n[None, :],
            h.to(h_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (offs_n < inter)[None, :],
        )

    @triton.jit
    def _quant_moe_down_kernel(
        h_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, y_ptr, weights_ptr,
        sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
        stride_hp, stride_qs, stride_qh, stride_s, stride_d, stride_yp,
        KIND: tl.constexpr, GROUP: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[pair, n] = weight[pair] * (h[pair] . w2_e[n]) in fp32 for one block of one
        expert's pairs and BLOCK_N of the H columns."""
        expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        HALF: tl.constexpr = GROUP // 2
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
        row_ok = pair < num_pairs
        h_rows = h_ptr + pair[:, None] * stride_hp
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < hidden)[None, None, :]
        rows = (expert * hidden + offs_n)[None, None, :]
        j = tl.arange(0, HALF)[None, :, None]
        t = tl.arange(0, BLOCK_K // 2)
        num_groups = inter // GROUP
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g0 in range(0, num_groups, GROUPS):
            g = g0 + tl.arange(0, GROUPS)[:, None, None]
            w_lo, w_hi = _expert_tile(
                qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, rows, n_ok, g, j, num_groups,
                stride_qs, stride_qh, stride_s, stride_d, KIND, GROUP, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            g_t = g0 + t // HALF
            k = (g_t * GROUP + t % HALF)[None, :]
            h_ok = row_ok[:, None] & (g_t < num_groups)[None, :]
            h_lo = tl.load(h_rows + k, mask=h_ok, other=0.0)
            h_hi = tl.load(h_rows + k + HALF, mask=h_ok, other=0.0)
            if UPCAST:
                h_lo, h_hi = h_lo.to(tl.float32), h_hi.to(tl.float32)
            else:
                w_lo, w_hi = w_lo.to(h_ptr.dtype.element_ty), w_hi.to(h_ptr.dtype.element_ty)
            acc = tl.dot(h_lo, w_lo, acc, input_precision=PRECISION)
            acc = tl.dot(h_hi, w_hi, acc, input_precision=PRECISION)
        acc = _channel_scale(acc, s_ptr, rows.reshape(BLOCK_N), offs_n < hidden, KIND)
        weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(
            y_ptr + pair[:, None] * stride_yp + offs_n[None, :],
            acc * weight[:, None],
            mask=row_ok[:, None] & (offs_n < hidden)[None, :],
        )


def _block_sizes(num_pairs: int, num_experts: int, group13: int, group2: int) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K13, BLOCK_K2): 16-row blocks when experts see few tokens each
    (decode), as fused_moe's; BLOCK_K a multiple of both kinds' groups and at least 32."""
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    return block_m, 64, max(64, group13), max(64, group2)


def _weight_args(qw: QuantWeight) -> tuple:
    qs = qw.qs
    qh, mins, d, dmin = (t if t is not None else qs for t in (qw.qh, qw.mins, qw.d, qw.dmin))
    tensors = (qs, qh, qw.scales, mins, d, dmin)
    return tensors, (qs.stride(0), qh.stride(0), qw.scales.stride(0), d.stride(0))


def triton_quant_fused_moe(
    x: torch.Tensor,
    w13: QuantWeight,
    w2: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """As naive_quant_fused_moe, in Triton: x [T, H] (bf16, fp16 or fp32); w13 [E*2I, H] and
    w2 [E*H, I] stacked QuantWeights; topk_weights, topk_ids [T, k] -> [T, H] in x.dtype.

    As triton_fused_moe: h [T*k, I] is kept in x.dtype, each slot's output in fp32, and the k
    slots are summed in fp32. No host sync (CUDA-graph safe)."""
    if triton is None:
        raise RuntimeError(
            "triton_quant_fused_moe needs triton, which is not installed; use naive_quant_fused_moe"
        )
    num_experts, inter = _check(x, w13, w2)
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_pairs = num_tokens * top_k
    group13, group2 = GROUP[w13.kind], GROUP[w2.kind]
    block_m, block_n, block_k13, block_k2 = _block_sizes(num_pairs, num_experts, group13, group2)
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    precision = _precision(x)
    upcast = x.device.type == "cpu" and x.dtype != torch.float32
    num_blocks = block_expert.shape[0]
    tensors, strides = _weight_args(w13)
    _quant_moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, *tensors, h, sorted_pairs, block_expert, num_pairs, hidden, inter,
        x.stride(0), *strides, h.stride(0),
        KIND=_DECODE[w13.kind], GROUP=group13, TOP_K=top_k, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k13,
    )  # fmt: skip
    tensors, strides = _weight_args(w2)
    _quant_moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, *tensors, y, weights, sorted_pairs, block_expert, num_pairs, hidden, inter,
        h.stride(0), *strides, y.stride(0),
        KIND=_DECODE[w2.kind], GROUP=group2, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k2,
    )  # fmt: skip
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
