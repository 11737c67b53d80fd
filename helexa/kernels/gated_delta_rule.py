"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3.5 / Qwen3-Next).

Per value head, with a state S: [K, V] and one token (q, k, v, g, beta):
    S = S * exp(g);  delta = (v - k^T S) * beta;  S = S + k ⊗ delta;  o = q^T S  (q pre-scaled)

Value head j reads q/k head j // (Hv/Hk) (HF's order: the value heads grouped by key head)
or, with `tiled=True`, head j % Hk (llama.cpp's GGUF order: the groups tiled, [Hv/Hk, Hk]).

Two forms, each as a plain-torch reference (`naive_*`, fp32, runs anywhere) beside its Triton
kernels (`triton_*`, after flash-linear-attention's decomposition):
- chunked prefill of one sequence: `naive_chunk_gated_delta_rule`, `triton_chunk_gated_delta_rule`
- one decode step of N sequences against a pool of states updated in place:
  `naive_recurrent_gated_delta_rule`, `triton_fused_recurrent_gated_delta_rule`
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the naive paths must work on machines without triton
    triton = None
    tl = None

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x*x) + eps) over the last dim, in fp32 (as HF and fla do)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _check_shapes(q, k, v, g, beta) -> None:
    num_tokens, num_k_heads = k.shape[:2]
    num_v_heads = v.shape[1]
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[0] != num_tokens or num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"v {tuple(v.shape)} must be [{num_tokens}, Hv, V] with Hv a multiple of {num_k_heads}"
        )
    if g.shape != (num_tokens, num_v_heads) or beta.shape != (num_tokens, num_v_heads):
        raise ValueError(
            f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{num_tokens}, {num_v_heads}]"
        )


def _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm, tiled):
    """fp32 q, k repeated to the value heads (head i serves Hv//Hk consecutive value heads,
    or every Hk-th one when `tiled`), l2-normalised if asked, q scaled."""
    head_k_dim = k.shape[-1]
    scale = head_k_dim**-0.5 if scale is None else scale
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    group = num_v_heads // k.shape[-2]
    if group > 1 and tiled:
        q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
    elif group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q * scale, k


def naive_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk, in plain torch (fp32 inside).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g: [T, Hv] log-decay (<= 0); beta: [T, Hv];
    initial_state: [Hv, K, V] fp32 or None (zeros). Hv % Hk == 0; q/k head i serves value heads
    i*(Hv//Hk) ... (i+1)*(Hv//Hk)-1, or i, i+Hk, i+2Hk, ... when `tiled`. scale None -> K**-0.5.
    Returns o: [T, Hv, V] in v.dtype and the final state [Hv, K, V] fp32 (a new tensor).
    """
    _check_shapes(q, k, v, g, beta)
    num_tokens, num_v_heads, head_v_dim = v.shape
    head_k_dim, out_dtype = k.shape[-1], v.dtype
    q, k = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm, tiled)
    # everything head-major from here: q, k: [Hv, T, K]; v: [Hv, T, V]; g, beta: [Hv, T]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    g, beta = g.float().t(), beta.float().t()

    # pad T to whole chunks: padded tokens have k = 0 and beta = 0, so they never touch the state
    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    num_chunks = (num_tokens + pad) // chunk_size
    # [Hv, num_chunks, C, D] and [Hv, num_chunks, C]
    q, k, v = (x.reshape(num_v_heads, num_chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(num_v_heads, num_chunks, chunk_size) for x in (g, beta))

    g_cum = g.cumsum(-1)  # log of the decay from the chunk's start up to and including t
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(g_cum_i - g_cum_j) for j <= i, else 0 (masked before exp: no inf * 0)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # The WY/UT form: the chunk's delta-rule updates are the solution of (I + A) x = rhs with
    # A[i, j] = beta_i (k_i . k_j) decay[i, j] for j < i. Solved by forward substitution
    # (solve_triangular), which stays finite on correlated keys where power series blow up.
    k_beta = k * beta[..., None]
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v * beta[..., None], k_beta * g_cum.exp()[..., None]], dim=-1)
    x = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u, w = x[..., :head_v_dim], x[..., head_v_dim:]  # u: [.., C, V]; w: [.., C, K]

    attn = (q @ k.transpose(-1, -2)) * decay  # within-chunk q.k, causal incl. the diagonal
    q_decayed = q * g_cum.exp()[..., None]  # reads the state as it was at the chunk's start
    g_last = g_cum[..., -1]  # [Hv, num_chunks]
    k_decayed = k * (g_last[..., None] - g_cum).exp()[..., None]  # decayed to the chunk's end

    if initial_state is None:
        state = q.new_zeros(num_v_heads, head_k_dim, head_v_dim)
    else:
        state = initial_state.to(device=q.device, dtype=torch.float32, copy=True)
    o = torch.empty_like(v)
    for c in range(num_chunks):
        v_new = u[:, c] - w[:, c] @ state  # [Hv, C, V]: what the state does not already predict
        o[:, c] = q_decayed[:, c] @ state + attn[:, c] @ v_new
        state = state * g_last[:, c, None, None].exp() + k_decayed[:, c].transpose(-1, -2) @ v_new

    o = o.reshape(num_v_heads, -1, head_v_dim)[:, :num_tokens].transpose(0, 1)
    return o.to(out_dtype).contiguous(), state


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
) -> torch.Tensor:
    """One decode step of N sequences (one token each) in plain torch (fp32 inside).

    q, k: [N, Hk, K]; v: [N, Hv, V]; g, beta: [N, Hv]; state: [S, Hv, K, V] fp32, a pool whose
    rows state_indices: [N] int64 (distinct) are updated in place; `tiled`: the value heads'
    order (see the module docstring). Returns o: [N, Hv, V] in v.dtype.
    """
    _check_shapes(q, k, v, g, beta)
    q, k = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm, tiled)  # [N, Hv, K]
    h = state[state_indices]  # [N, Hv, K, V], a copy
    h = h * g.float().exp()[..., None, None]
    kv = (h * k[..., None]).sum(-2)  # [N, Hv, V]
    delta = (v.float() - kv) * beta.float()[..., None]
    h = h + k[..., None] * delta[..., None, :]
    state[state_indices] = h
    return (h * q[..., None]).sum(-2).to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Triton. The chunked form follows flash-linear-attention's decomposition:
#   1. g_cum: the log-decay summed within each chunk                       (parallel over chunks)
#   2. per chunk: A = beta k k^T with decay, X = (I + A)^-1 by forward substitution,
#      w = X (beta exp(g_cum) k), u = X (beta v)                           (parallel over chunks)
#   3. the state at each chunk's start, one chunk after another; v_new = u - w S
#                                                        (sequential; parallel over heads, V)
#   4. o = (q S) exp(g_cum) + (q k^T with decay) v_new                    (parallel over chunks)
# Intermediates are fp32, token-major like the inputs: [T, Hv, *] and h: [num_chunks, Hv, K, V].
# Every tl.dot takes fp32 tiles. PRECISION: TF32 for a half-precision model (fla runs these in
# bf16), 3xTF32 for a float32 one on the GPU, so that it matches torch to ~1e-6 as the other
# kernels do (plain TF32 missed the selftest's fp32 bound on an H100: 2.5e-3); exact in the
# interpreter.

CHUNK_SIZE = 64

if triton is not None:

    @triton.jit
    def _key_head(i_h, HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr):
        # the q/k head value head i_h reads: grouped [Hk, Hv/Hk] or tiled [Hv/Hk, Hk]
        if TILED:
            i_hk = i_h % HK
        else:
            i_hk = i_h // (HV // HK)
        return i_hk

    @triton.jit
    def _chunk_cumsum_kernel(g, g_cum, T, H: tl.constexpr, C: tl.constexpr):
        # grid (num_chunks, Hv); g, g_cum: [T, Hv]
        i_c, i_h = tl.program_id(0), tl.program_id(1)
        t = i_c * C + tl.arange(0, C)
        b_g = tl.load(g + t * H + i_h, mask=t < T, other=0.0).to(tl.float32)
        tl.store(g_cum + t * H + i_h, tl.cumsum(b_g, axis=0), mask=t < T)

    @triton.jit
    def _chunk_wy_kernel(
        k, v, beta, g_cum, w, u, T,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
        TILED: tl.constexpr,
    ):  # fmt: skip
        # grid (num_chunks, Hv); k: [T, Hk, K]; v, u: [T, Hv, V]; w: [T, Hv, K]; beta: [T, Hv]
        i_c, i_h = tl.program_id(0), tl.program_id(1)
        i_hk = _key_head(i_h, HK, HV, TILED)
        r = tl.arange(0, C)
        t = i_c * C + r
        m_t = t < T
        o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)

        b_a = tl.zeros([C, C], dtype=tl.float32)  # k k^T over the chunk
        for k0 in range(0, K, BK):
            m_k = m_t[:, None] & (k0 + o_k < K)[None, :]
            b_k = tl.load(k + (t[:, None] * HK + i_hk) * K + k0 + o_k[None, :], mask=m_k, other=0.0)
            b_a += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        b_gc = tl.load(g_cum + t * HV + i_h, mask=m_t, other=0.0)
        b_beta = tl.load(beta + t * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        # A[i, j] = beta_i k_i.k_j exp(g_cum_i - g_cum_j), j < i; the exponent is masked before
        # exp, so padded rows (g_cum 0 beside a very negative one) cannot overflow into inf * 0
        is_lower = (r[:, None] > r[None, :]) & m_t[:, None] & m_t[None, :]
        b_decay = tl.exp(tl.where(is_lower, b_gc[:, None] - b_gc[None, :], 0.0))
        b_a = tl.where(is_lower, b_a * b_decay * b_beta[:, None], 0.0)

        # X = (I + A)^-1 row by row: x_i = e_i - sum_{j<i} A[i, j] x_j (rows j >= i still 0)
        b_x = tl.zeros([C, C], dtype=tl.float32)
        for i in range(0, tl.minimum(T - i_c * C, C)):
            b_ai = tl.sum(tl.where(r[:, None] == i, b_a, 0.0), axis=0)  # [C]: row i of A
            b_xi = tl.where(r == i, 1.0, 0.0) - tl.sum(b_ai[:, None] * b_x, axis=0)
            b_x = tl.where(r[:, None] == i, b_xi[None, :], b_x)

        for v0 in range(0, V, BV):
            m_v = m_t[:, None] & (v0 + o_v < V)[None, :]
            p = (t[:, None] * HV + i_h) * V + v0 + o_v[None, :]
            b_v = tl.load(v + p, mask=m_v, other=0.0).to(tl.float32) * b_beta[:, None]
            tl.store(u + p, tl.dot(b_x, b_v, input_precision=PRECISION), mask=m_v)
        b_kscale = b_beta * tl.exp(b_gc)
        for k0 in range(0, K, BK):
            m_k = m_t[:, None] & (k0 + o_k < K)[None, :]
            b_k = tl.load(k + (t[:, None] * HK + i_hk) * K + k0 + o_k[None, :], mask=m_k, other=0.0)
            p = (t[:, None] * HV + i_h) * K + k0 + o_k[None, :]
            tl.store(
                w + p, tl.dot(b_x, b_k * b_kscale[:, None], input_precision=PRECISION), mask=m_k
            )

    @triton.jit
    def _chunk_state_kernel(
        k, w, u, g_cum, h0, h, v_new, ht, T,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
        PRECISION: tl.constexpr, TILED: tl.constexpr,
    ):  # fmt: skip
        # grid (cdiv(V, BV), Hv); h: [num_chunks, Hv, K, V]; h0, ht: [Hv, K, V]; BK >= K
        i_v, i_h = tl.program_id(0), tl.program_id(1)
        i_hk = _key_head(i_h, HK, HV, TILED)
        r, o_k = tl.arange(0, C), tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
        p_kv = (o_k[:, None] * V + o_v[None, :]).to(tl.int64)  # within one [K, V] state

        if HAS_H0:
            b_h = tl.load(h0 + i_h * K * V + p_kv, mask=m_kv, other=0.0)  # [BK, BV]
        else:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)
        for i_c in range(0, tl.cdiv(T, C)):
            tl.store(h + (i_c * HV + i_h).to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)
            t = i_c * C + r
            m_t = t < T
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tv = (t[:, None] * HV + i_h) * V + o_v[None, :]
            b_w = tl.load(w + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_vn = tl.load(u + p_tv, mask=m_tv, other=0.0) - tl.dot(
                b_w, b_h, input_precision=PRECISION
            )  # [C, BV]
            tl.store(v_new + p_tv, b_vn, mask=m_tv)

            # the state at the chunk's end: decayed by the whole chunk, plus each token's
            # correction decayed from its position to the chunk's end
            b_gc = tl.load(g_cum + t * HV + i_h, mask=m_t, other=0.0)
            b_glast = tl.load(g_cum + (tl.minimum(T, i_c * C + C) - 1) * HV + i_h)
            b_k = tl.load(k + (t[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_k = b_k * tl.exp(tl.where(m_t, b_glast - b_gc, 0.0))[:, None]
            b_h = b_h * tl.exp(b_glast) + tl.dot(tl.trans(b_k), b_vn, input_precision=PRECISION)
        tl.store(ht + i_h * K * V + p_kv, b_h, mask=m_kv)

    @triton.jit
    def _chunk_output_kernel(
        q, k, v_new, g_cum, h, o, T, scale,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
        TILED: tl.constexpr,
    ):  # fmt: skip
        # grid (cdiv(V, BV), num_chunks, Hv); q, k: [T, Hk, K]; v_new, o: [T, Hv, V]
        i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_hk = _key_head(i_h, HK, HV, TILED)
        r, o_k = tl.arange(0, C), tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        t = i_c * C + r
        m_t = t < T
        h += (i_c * HV + i_h).to(tl.int64) * K * V

        b_qh = tl.zeros([C, BV], dtype=tl.float32)  # q S: the state as at the chunk's start
        b_qk = tl.zeros([C, C], dtype=tl.float32)
        for k0 in range(0, K, BK):
            m_k = k0 + o_k < K
            p_tk = (t[:, None] * HK + i_hk) * K + k0 + o_k[None, :]
            b_q = tl.load(q + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_k = tl.load(k + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.0)
            p_h = (k0 + o_k[:, None]) * V + o_v[None, :]
            b_h = tl.load(h + p_h, mask=m_k[:, None] & (o_v < V)[None, :], other=0.0)
            b_qh += tl.dot(b_q, b_h, input_precision=PRECISION)
            b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        b_gc = tl.load(g_cum + t * HV + i_h, mask=m_t, other=0.0)
        is_causal = (r[:, None] >= r[None, :]) & m_t[:, None] & m_t[None, :]
        b_decay = tl.exp(tl.where(is_causal, b_gc[:, None] - b_gc[None, :], 0.0))
        b_qk = tl.where(is_causal, b_qk * b_decay, 0.0)

        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (t[:, None] * HV + i_h) * V + o_v[None, :]
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_o = (b_qh * tl.exp(b_gc)[:, None] + tl.dot(b_qk, b_vn, input_precision=PRECISION)) * scale
        tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)

    @triton.jit
    def _fused_recurrent_kernel(
        q, k, v, g, beta, state, state_indices, o, scale,
        HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, EPS: tl.constexpr,
        TILED: tl.constexpr,
    ):  # fmt: skip
        # grid (N, Hv, cdiv(V, BV)); q, k: [N, Hk, K]; v, o: [N, Hv, V]; g, beta: [N, Hv];
        # state: [S, Hv, K, V] fp32, row state_indices[n] read and written back in place
        i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_hk = _key_head(i_h, HK, HV, TILED)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V

        b_q = tl.load(q + (i_n * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (i_n * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + EPS)
        b_q = b_q * scale
        b_v = tl.load(v + (i_n * HV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_n * HV + i_h).to(tl.float32)
        b_beta = tl.load(beta + i_n * HV + i_h).to(tl.float32)

        row = tl.load(state_indices + i_n).to(tl.int64)
        p_h = state + (row * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        m_h = m_k[:, None] & m_v[None, :]
        b_h = tl.load(p_h, mask=m_h, other=0.0) * tl.exp(b_g)  # [BK, BV]
        b_delta = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta  # [BV]
        b_h += b_k[:, None] * b_delta[None, :]
        tl.store(p_h, b_h, mask=m_h)
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + (i_n * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the naive_* gated delta rule instead")


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _chunk_launch(q, k, v, g, beta, initial_state, scale, chunk_size, tiled):
    """Launch the four chunk kernels; q, k fp32 [T, Hk, K] (normalised); v [T, Hv, V];
    g, beta fp32 [T, Hv]. Returns o [T, Hv, V] in v.dtype and the final state [Hv, K, V]."""
    num_tokens, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[1:]
    C, num_chunks = chunk_size, triton.cdiv(num_tokens, chunk_size)
    BK, BV = min(64, _pow2(head_k_dim)), min(64, _pow2(head_v_dim))  # blocks looped over
    # The state kernel holds a whole [K, BV] state tile and [C, K] tiles of k and w in
    # registers: narrow V blocks keep that from spilling on sm_90 up to K = 128 (ptxas -v).
    BK_STATE = _pow2(head_k_dim)
    BV_STATE = min(16 if BK_STATE >= 128 else 32, _pow2(head_v_dim))
    dims = dict(HK=num_k_heads, HV=num_v_heads, K=head_k_dim, V=head_v_dim, C=C, TILED=tiled)
    if v.dtype != torch.float32:
        precision = "tf32"
    else:
        precision = "tf32x3" if v.is_cuda else "ieee"
    dims["PRECISION"] = precision
    f32 = dict(device=v.device, dtype=torch.float32)

    g_cum = torch.empty(num_tokens, num_v_heads, **f32)
    _chunk_cumsum_kernel[(num_chunks, num_v_heads)](g, g_cum, num_tokens, num_v_heads, C)

    w = torch.empty(num_tokens, num_v_heads, head_k_dim, **f32)
    u = torch.empty(num_tokens, num_v_heads, head_v_dim, **f32)
    _chunk_wy_kernel[(num_chunks, num_v_heads)](
        k, v, beta, g_cum, w, u, num_tokens, **dims, BK=BK, BV=BV, num_warps=8
    )

    h = torch.empty(num_chunks, num_v_heads, head_k_dim, head_v_dim, **f32)
    v_new = torch.empty_like(u)
    final_state = torch.empty(num_v_heads, head_k_dim, head_v_dim, **f32)
    has_h0 = initial_state is not None
    h0 = initial_state.float().contiguous() if has_h0 else final_state  # unread when None
    grid = (triton.cdiv(head_v_dim, BV_STATE), num_v_heads)
    _chunk_state_kernel[grid](
        k, w, u, g_cum, h0, h, v_new, final_state, num_tokens,
        **dims, BK=BK_STATE, BV=BV_STATE, HAS_H0=has_h0,
        num_warps=4 if BK_STATE >= 128 else 8, num_stages=1,  # one chunk after another
    )  # fmt: skip

    o = torch.empty_like(v)
    grid = (triton.cdiv(head_v_dim, BV), num_chunks, num_v_heads)
    _chunk_output_kernel[grid](
        q, k, v_new, g_cum, h, o, num_tokens, scale, **dims, BK=BK, BV=BV, num_warps=8
    )
    return o, final_state


def triton_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunked, in Triton (fp32 tensors, TF32 matmuls).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g: [T, Hv] log-decay (<= 0); beta: [T, Hv];
    initial_state: [Hv, K, V] fp32 or None (zeros). Hv % Hk == 0; q/k head i serves value heads
    i*(Hv//Hk) ... (i+1)*(Hv//Hk)-1, or i, i+Hk, i+2Hk, ... when `tiled`. scale None -> K**-0.5.
    Returns o: [T, Hv, V] in v.dtype and the final state [Hv, K, V] fp32 (a new tensor).
    """
    _require_triton()
    _check_shapes(q, k, v, g, beta)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k = (_l2norm(x) if use_qk_l2norm else x.float() for x in (q, k))
    return _chunk_launch(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.float().contiguous(),
        beta.float().contiguous(),
        initial_state,
        scale,
        CHUNK_SIZE,
        tiled,
    )


def triton_fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
) -> torch.Tensor:
    """One decode step of N sequences (one token each), one Triton kernel.

    q, k: [N, Hk, K]; v: [N, Hv, V]; g, beta: [N, Hv]; state: [S, Hv, K, V] fp32, a pool whose
    rows state_indices: [N] int64 (distinct) are updated in place; `tiled`: the value heads'
    order (see the module docstring). Returns o: [N, Hv, V] in v.dtype.
    """
    _require_triton()
    _check_shapes(q, k, v, g, beta)
    num_seqs, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[1:]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 (updated in place), got {state.dtype}")
    if state.shape[1:] != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(
            f"state {tuple(state.shape)} must be [S, {num_v_heads}, {head_k_dim}, {head_v_dim}]"
        )
    scale = head_k_dim**-0.5 if scale is None else scale
    BK, BV = _pow2(head_k_dim), min(32, _pow2(head_v_dim))
    o = torch.empty(num_seqs, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)
    grid = (num_seqs, num_v_heads, triton.cdiv(head_v_dim, BV))
    _fused_recurrent_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        state, state_indices.contiguous(), o, scale,
        HK=num_k_heads, HV=num_v_heads, K=head_k_dim, V=head_v_dim, BK=BK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, TILED=tiled,
    )  # fmt: skip
    return o
