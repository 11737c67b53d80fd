"""The GDN gates: the naive version against HF's formula, the Triton one against the naive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.gdn_gating import naive_gdn_gating, triton_gdn_gating

from . import DEVICE, max_rel_error, needs_triton


def gating_inputs(num_tokens: int, num_heads: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(num_tokens, num_heads, generator=gen) * 8).to(dtype)  # reaches softplus > 20
    b = (torch.randn(num_tokens, num_heads, generator=gen) * 3).to(dtype)
    A_log = torch.randn(num_heads, generator=gen)
    dt_bias = torch.randn(num_heads, generator=gen)
    return A_log, a, b, dt_bias


def test_naive_gating_is_hf_formula_in_fp32():
    # HF keeps beta in b's dtype; here it is fp32 from the start, so compare to b.float()
    A_log, a, b, dt_bias = gating_inputs(63, 60, torch.bfloat16)
    g, beta = naive_gdn_gating(A_log, a, b, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias))
    torch.testing.assert_close(beta, b.float().sigmoid())


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 63])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gating_matches_naive(num_tokens, dtype):
    A_log, a, b, dt_bias = (t.to(DEVICE) for t in gating_inputs(num_tokens, 60, dtype))
    g, beta = triton_gdn_gating(A_log, a, b, dt_bias)
    want_g, want_beta = naive_gdn_gating(A_log, a, b, dt_bias)
    # elementwise fp32 math on the same inputs: only exp/log/sigmoid's last bits differ
    assert max_rel_error(g, want_g) < 1e-5
    assert max_rel_error(beta, want_beta) < 1e-5


@needs_triton
def test_triton_softplus_keeps_tiny_decays_and_passes_large_inputs_through():
    # x far below 0: softplus(x) = exp(x), which a plain log(1 + exp(x)) rounds to 0; x > 20: x
    a = torch.tensor([[-30.0, -17.0, 0.0, 19.0, 21.0, 60.0]], device=DEVICE)
    zeros = torch.zeros(6, device=DEVICE)
    g, _ = triton_gdn_gating(zeros, a, a, zeros)
    torch.testing.assert_close(g, -F.softplus(a), rtol=1e-6, atol=0)


@needs_triton
def test_triton_gating_reads_column_slices_of_one_projection():
    # the model splits b and a out of one projection's output: strided views
    A_log, a, b, dt_bias = (t.to(DEVICE) for t in gating_inputs(63, 60))
    ba = torch.cat([b, a], dim=1)
    g, beta = triton_gdn_gating(A_log, ba[:, 60:], ba[:, :60], dt_bias)
    want_g, want_beta = naive_gdn_gating(A_log, a, b, dt_bias)
    assert max_rel_error(g, want_g) < 1e-5
    assert max_rel_error(beta, want_beta) < 1e-5
