"""The gated delta rule: naive chunked vs naive recurrent vs HF's reference, and the Triton
kernels vs the naive ones (on CPU through Triton's interpreter).

Error bound: everything is fp32 (the interpreter's tl.dot is an exact fp32 matmul, not tf32);
the chunked forms reorder the sums of the token-by-token recurrence and go through a triangular
solve, so the paths differ by a few fp32 ulps times the depth of the sums: up to ~3e-6 seen.
max|a - b| / max|b| < 1e-4 leaves over an order of magnitude of headroom, yet catches any wrong
mask, decay or index, which shows up at 1e-2 or worse.
"""

from __future__ import annotations

import importlib.util
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: kernels run on CPU

import pytest
import torch

import helexa.kernels.gated_delta_rule as gdr
from helexa.kernels.gated_delta_rule import (
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)

REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_inputs(T, Hk, Hv, K, V, *, seed=0, dtype=torch.float32):
    """Random q, k, v, g (log-decay, in about [-1.5, 0]), beta (in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, K, generator=gen).to(dtype)
    k = torch.randn(T, Hk, K, generator=gen).to(dtype)
    v = torch.randn(T, Hv, V, generator=gen).to(dtype)
    g = -torch.rand(T, Hv, generator=gen) * 1.5
    beta = torch.rand(T, Hv, generator=gen)
    return q, k, v, g, beta


def recurrent_token_by_token(q, k, v, g, beta, initial_state=None, **kw):
    """The whole sequence through the one-step decode function, one token at a time."""
    Hv, K, V = v.shape[1], k.shape[-1], v.shape[-1]
    pool = torch.zeros(1, Hv, K, V) if initial_state is None else initial_state[None].clone()
    rows = torch.zeros(1, dtype=torch.int64)
    o = [
        naive_recurrent_gated_delta_rule(
            q[t : t + 1],
            k[t : t + 1],
            v[t : t + 1],
            g[t : t + 1],
            beta[t : t + 1],
            pool,
            rows,
            **kw,
        )
        for t in range(q.shape[0])
    ]
    return torch.cat(o), pool[0]


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize(("K", "V"), [(60, 60), (64, 32)])
@pytest.mark.parametrize("with_state", [False, True])
def test_naive_chunk_matches_the_token_by_token_recurrence(T, K, V, with_state):
    q, k, v, g, beta = make_inputs(T, 2, 4, K, V, seed=T + K)
    h0 = torch.randn(4, K, V, generator=torch.Generator().manual_seed(1)) if with_state else None
    h0_before = None if h0 is None else h0.clone()
    o, h = naive_chunk_gated_delta_rule(q, k, v, g, beta, h0)
    o_ref, h_ref = recurrent_token_by_token(q, k, v, g, beta, h0)
    assert o.shape == (T, 4, V) and o.dtype == v.dtype
    assert h.shape == (4, K, V) and h.dtype == torch.float32
    assert rel_err(o, o_ref) < REL_TOL
    assert rel_err(h, h_ref) < REL_TOL
    if h0 is not None:
        assert torch.equal(h0, h0_before)  # the initial state is not modified


def test_naive_chunk_matches_hf_torch_chunk_gated_delta_rule():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = make_inputs(100, 2, 4, 60, 60, seed=7)
    h0 = torch.randn(4, 60, 60, generator=torch.Generator().manual_seed(2))
    o, h = naive_chunk_gated_delta_rule(q, k, v, g, beta, h0)
    o_hf, h_hf = hf.torch_chunk_gated_delta_rule(
        *(x[None] for x in (q, k, v, g, beta)),
        initial_state=h0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, o_hf[0]) < REL_TOL
    assert rel_err(h, h_hf[0]) < REL_TOL


def test_naive_recurrent_matches_hf_torch_recurrent_gated_delta_rule():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = make_inputs(20, 2, 4, 60, 32, seed=8)
    h0 = torch.randn(4, 60, 32, generator=torch.Generator().manual_seed(3))
    o, h = recurrent_token_by_token(q, k, v, g, beta, h0)
    o_hf, h_hf = hf.torch_recurrent_gated_delta_rule(
        *(x[None] for x in (q, k, v, g, beta)),
        initial_state=h0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, o_hf[0]) < REL_TOL
    assert rel_err(h, h_hf[0]) < REL_TOL


def test_naive_recurrent_updates_only_the_listed_pool_rows():
    q, k, v, g, beta = make_inputs(3, 2, 4, 60, 60, seed=9)
    pool = torch.randn(5, 4, 60, 60, generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    rows = torch.tensor([3, 0, 4])
    o = naive_recurrent_gated_delta_rule(q, k, v, g, beta, pool, rows)
    for n, row in enumerate(rows.tolist()):
        o_one, h_one = naive_chunk_gated_delta_rule(
            *(x[n : n + 1] for x in (q, k, v, g, beta)), before[row]
        )
        assert rel_err(o[n], o_one[0]) < REL_TOL
        assert rel_err(pool[row], h_one) < REL_TOL
    assert torch.equal(pool[[1, 2]], before[[1, 2]])


def test_naive_chunk_keeps_bf16_inputs_in_bf16_out():
    q, k, v, g, beta = make_inputs(40, 2, 2, 32, 32, seed=10, dtype=torch.bfloat16)
    o, h = naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=0.1, use_qk_l2norm=False)
    o_ref, h_ref = recurrent_token_by_token(q, k, v, g, beta, scale=0.1, use_qk_l2norm=False)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert rel_err(h, h_ref) < REL_TOL
    assert rel_err(o, o_ref) < 1e-2  # both round the same fp32 result to bf16


def correlated_inputs(T=512, K=64, V=32):
    """Nearly the same key every token, some exactly repeated, beta near 1, almost no decay."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1, 1, K, generator=gen)
    k = base + 1e-3 * torch.randn(T, 1, K, generator=gen)
    k[::3] = base
    q = torch.randn(T, 1, K, generator=gen)
    v = torch.randn(T, 2, V, generator=gen)
    g = -torch.rand(T, 2, generator=gen) * 1e-3
    beta = torch.full((T, 2), 0.99)
    return q, k, v, g, beta


def test_naive_chunk_stays_finite_on_repeated_and_correlated_keys():
    # Every entry of the chunk's triangular system near beta is as ill-behaved as it gets; a
    # power-series (nilpotent squaring) inverse of it is off by ~1e10 in fp32 here.
    q, k, v, g, beta = correlated_inputs()
    o, h = naive_chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, h_ref = recurrent_token_by_token(q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert rel_err(o, o_ref) < REL_TOL
    assert rel_err(h, h_ref) < REL_TOL


# --- Triton, through the interpreter ----------------------------------------------------------


@pytest.fixture
def triton_gdr():
    """The module, once triton is known to import (the interpreter runs the kernels on CPU)."""
    pytest.importorskip("triton")
    return gdr


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize(("K", "V"), [(60, 60), (64, 32)])
@pytest.mark.parametrize("with_state", [False, True])
def test_triton_chunk_matches_naive(triton_gdr, T, K, V, with_state):
    q, k, v, g, beta = make_inputs(T, 2, 4, K, V, seed=T + K)
    h0 = torch.randn(4, K, V, generator=torch.Generator().manual_seed(1)) if with_state else None
    h0_before = None if h0 is None else h0.clone()
    o, h = triton_gdr.triton_chunk_gated_delta_rule(q, k, v, g, beta, h0)
    o_ref, h_ref = naive_chunk_gated_delta_rule(q, k, v, g, beta, h0)
    assert o.shape == (T, 4, V) and o.dtype == v.dtype
    assert h.shape == (4, K, V) and h.dtype == torch.float32
    assert rel_err(o, o_ref) < REL_TOL
    assert rel_err(h, h_ref) < REL_TOL
    if h0 is not None:
        assert torch.equal(h0, h0_before) and h is not h0


def test_triton_chunk_stays_finite_on_repeated_and_correlated_keys(triton_gdr):
    q, k, v, g, beta = correlated_inputs(T=300)
    o, h = triton_gdr.triton_chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, h_ref = naive_chunk_gated_delta_rule(q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert rel_err(o, o_ref) < REL_TOL
    assert rel_err(h, h_ref) < REL_TOL


def test_triton_chunk_takes_bf16_without_l2norm_and_an_explicit_scale(triton_gdr):
    q, k, v, g, beta = make_inputs(70, 1, 2, 32, 48, seed=11, dtype=torch.bfloat16)
    kw = dict(scale=0.1, use_qk_l2norm=False)
    o, h = triton_gdr.triton_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_ref, h_ref = naive_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.dtype == torch.bfloat16
    assert rel_err(h, h_ref) < REL_TOL
    assert rel_err(o, o_ref) < 1e-2  # both round the same fp32 result to bf16


@pytest.mark.parametrize(("K", "V"), [(60, 60), (64, 32)])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_triton_fused_recurrent_updates_the_listed_pool_rows_like_naive(
    triton_gdr, K, V, use_qk_l2norm
):
    q, k, v, g, beta = make_inputs(3, 2, 4, K, V, seed=K + V)
    pool = torch.randn(5, 4, K, V, generator=torch.Generator().manual_seed(6))
    pool_ref = pool.clone()
    rows = torch.tensor([3, 0, 4])
    kw = dict(use_qk_l2norm=use_qk_l2norm, scale=None if use_qk_l2norm else 0.05)
    o = triton_gdr.triton_fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, rows, **kw)
    o_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, pool_ref, rows, **kw)
    assert o.shape == (3, 4, V) and o.dtype == v.dtype
    assert rel_err(o, o_ref) < REL_TOL
    assert rel_err(pool[rows], pool_ref[rows]) < REL_TOL
    assert torch.equal(pool[[1, 2]], pool_ref[[1, 2]])  # rows not listed are untouched


def _tiled(num_k_heads: int, num_v_heads: int) -> torch.Tensor:
    """Index taking value heads grouped by key head, [Hk, Hv/Hk], to tiled, [Hv/Hk, Hk]."""
    return torch.arange(num_v_heads).reshape(num_k_heads, -1).t().reshape(-1)


@pytest.mark.parametrize("form", ["naive", "triton"])
def test_tiled_value_heads_give_the_grouped_result_in_their_own_order(form):
    if form == "triton":
        pytest.importorskip("triton")
    chunk, recurrent = (
        (gdr.naive_chunk_gated_delta_rule, gdr.naive_recurrent_gated_delta_rule)
        if form == "naive"
        else (gdr.triton_chunk_gated_delta_rule, gdr.triton_fused_recurrent_gated_delta_rule)
    )
    q, k, v, g, beta = make_inputs(63, 2, 6, 60, 32, seed=5)  # three value heads per key head
    h0 = torch.randn(6, 60, 32, generator=torch.Generator().manual_seed(2))
    t = _tiled(2, 6)
    o, h = chunk(q, k, v, g, beta, h0)
    o_tiled, h_tiled = chunk(q, k, v[:, t], g[:, t], beta[:, t], h0[t], tiled=True)
    assert torch.equal(o_tiled, o[:, t]) and torch.equal(h_tiled, h[t])

    pool = torch.randn(3, 6, 60, 32, generator=torch.Generator().manual_seed(3))
    pool_tiled, rows = pool[:, t].clone(), torch.tensor([2, 0])
    step = [x[:2] for x in (q, k, v, g, beta)]
    o = recurrent(*step, pool, rows)
    step[2:] = [x[:, t] for x in step[2:]]
    assert torch.equal(recurrent(*step, pool_tiled, rows, tiled=True), o[:, t])
    assert torch.equal(pool_tiled, pool[:, t])


def test_triton_functions_say_so_when_triton_is_missing(monkeypatch):
    monkeypatch.setattr(gdr, "triton", None)
    q, k, v, g, beta = make_inputs(4, 1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        gdr.triton_chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        gdr.triton_fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, torch.zeros(1, 1, 16, 16), torch.zeros(1, dtype=torch.int64)
        )


def test_module_imports_and_naive_paths_run_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("gdr_without_triton", gdr.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None
    q, k, v, g, beta = make_inputs(5, 1, 1, 16, 16)
    o, _ = module.naive_chunk_gated_delta_rule(q, k, v, g, beta)
    assert rel_err(o, naive_chunk_gated_delta_rule(q, k, v, g, beta)[0]) == 0
