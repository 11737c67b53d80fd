"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3.5 / Qwen3-Next).

Per value head, with a state S: [K, V] and one token (q, k, v, g, beta):
    S = S * exp(g);  delta = (v - k^T S) * beta;  S = S + k ⊗ delta;  o = q^T S  (q pre-scaled)

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


def _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm):
    """fp32 q, k repeated to the value heads (head i serves Hv//Hk consecutive value heads),
    l2-normalised if asked, q scaled."""
    head_k_dim = k.shape[-1]
    scale = head_k_dim**-0.5 if scale is None else scale
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    group = num_v_heads // k.shape[-2]
    if group > 1:
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk, in plain torch (fp32 inside).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g: [T, Hv] log-decay (<= 0); beta: [T, Hv];
    initial_state: [Hv, K, V] fp32 or None (zeros). Hv % Hk == 0; q/k head i serves value heads
    i*(Hv//Hk) ... (i+1)*(Hv//Hk)-1. scale None -> K**-0.5.
    Returns o: [T, Hv, V] in v.dtype and the final state [Hv, K, V] fp32 (a new tensor).
    """
    _check_shapes(q, k, v, g, beta)
    num_tokens, num_v_heads, head_v_dim = v.shape
    head_k_dim, out_dtype = k.shape[-1], v.dtype
    q, k = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
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
) -> torch.Tensor:
    """One decode step of N sequences (one token each) in plain torch (fp32 inside).

    q, k: [N, Hk, K]; v: [N, Hv, V]; g, beta: [N, Hv]; state: [S, Hv, K, V] fp32, a pool whose
    rows state_indices: [N] int64 (distinct) are updated in place. Returns o: [N, Hv, V] in v.dtype.
    """
    _check_shapes(q, k, v, g, beta)
    q, k = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm)  # [N, Hv, K]
    h = state[state_indices]  # [N, Hv, K, V], a copy
    h = h * g.float().exp()[..., None, None]
    kv = (h * k[..., None]).sum(-2)  # [N, Hv, V]
    delta = (v.float() - kv) * beta.float()[..., None]
    h = h + k[..., None] * delta[..., None, :]
    state[state_indices] = h
    return (h * q[..., None]).sum(-2).to(v.dtype)
