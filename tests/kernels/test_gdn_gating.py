"""The GDN gates: the naive version against HF's formula, the Triton one against the naive."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helexa.kernels.gdn_gating import naive_gdn_gating


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
