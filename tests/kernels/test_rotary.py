"""Rotary embedding of q and k: the naive version against the engine's apply_rotary and
Qwen3.5's apply_partial_rotary as they were before the kernel (bit for bit), the Triton one
against the naive."""

from __future__ import annotations

import pytest
import torch

from helexa.engine.layers.rotary import RotaryEmbedding
from helexa.kernels.rotary import naive_rotary, triton_rotary

from . import DEVICE, max_rel_error, needs_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# fp32: x*cos + y*sin with or without a fused multiply-add; bf16: two roundings (x * cos,
# then the sum), each a truncation (up to an ulp, 2^-7) in Triton's interpreter
BOUND = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


def engine_apply_rotary(x, cos, signed_sin):
    """layers/rotary.py's apply_rotary before kernels.rotary."""
    n, heads, d = x.shape
    swapped = x.reshape(n, heads, 2, d // 2).flip(2).view(n, heads, d)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, signed_sin)


def engine_apply_partial_rotary(x, cos, sin):
    """models/qwen3_5.py's apply_partial_rotary before kernels.rotary."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return engine_apply_rotary(x, cos, sin)
    return torch.cat((engine_apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


def rotary_inputs(num_tokens, hq, hk, head_dim, rotary_dim, dtype, device=DEVICE, seed=0):
    """q, k as Llama's split of one fused qkv (strided views); cos, sin from the real tables
    at scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, hq + 2 * hk, head_dim, generator=gen).to(device, dtype)
    q, k, _ = qkv.split([hq, hk, hk], dim=1)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    cos, sin = RotaryEmbedding(rotary_dim, 4096, 1e6).lookup(positions, dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_naive_is_the_engines_formula_bit_for_bit(dtype, rotary_dim):
    q, k, cos, sin = rotary_inputs(63, 4, 2, 64, rotary_dim, dtype, device="cpu")
    got_q, got_k = naive_rotary(q, k, cos, sin)
    assert torch.equal(got_q, engine_apply_partial_rotary(q, cos, sin))
    assert torch.equal(got_k, engine_apply_partial_rotary(k, cos, sin))
    if rotary_dim == 64:  # Llama rotated q and k as one view of the fused qkv
        both = engine_apply_rotary(torch.cat((q, k), dim=1), cos, sin)
        assert torch.equal(torch.cat((got_q, got_k), dim=1), both)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"),
    [(64, 64), (60, 60), (60, 16), (64, 16)],  # partial: Qwen3.5 rotates a quarter
)
def test_triton_matches_naive(dtype, head_dim, rotary_dim):
    q, k, cos, sin = rotary_inputs(63, 4, 2, head_dim, rotary_dim, dtype)
    got_q, got_k = triton_rotary(q, k, cos, sin)
    want_q, want_k = naive_rotary(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert max_rel_error(got_q, want_q) < BOUND[dtype]
    assert max_rel_error(got_k, want_k) < BOUND[dtype]
    if rotary_dim < head_dim:  # the rest passes through untouched
        assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


@needs_triton
def test_triton_rotates_one_token_and_contiguous_heads_with_more_k_than_q_blocks():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 64, generator=gen).to(DEVICE)
    k = torch.randn(1, 5, 64, generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(64, 128, 1e4).lookup(torch.tensor([77], device=DEVICE), q.dtype)
    got_q, got_k = triton_rotary(q, k, cos, sin)
    want_q, want_k = naive_rotary(q, k, cos, sin)
    assert max_rel_error(got_q, want_q) < 1e-6
    assert max_rel_error(got_k, want_k) < 1e-6
    assert triton_rotary(q[:0], k[:0], cos[:0], sin[:0])[0].shape == (0, 3, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("hq", "hk", "head_dim", "rotary_dim"),
    [(32, 8, 128, 128), (24, 4, 256, 64)],  # Qwen3-8B; Qwen3.5's partial rotary
)
def test_gpu_rotary_at_real_sizes(hq, hk, head_dim, rotary_dim):
    for num_tokens in (1, 512):
        q, k, cos, sin = rotary_inputs(
            num_tokens, hq, hk, head_dim, rotary_dim, torch.bfloat16, device="cuda"
        )
        got_q, got_k = triton_rotary(q, k, cos, sin)
        want_q, want_k = naive_rotary(q, k, cos, sin)
        assert max_rel_error(got_q, want_q) < 1e-2
        assert max_rel_error(got_k, want_k) < 1e-2
