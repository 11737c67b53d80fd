"""RMSNorm (and its fused residual add): the naive version against the engine's formula as it
was before the kernel (bit for bit), the Triton one against the naive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.rms_norm import naive_rms_norm, triton_rms_norm

from . import DEVICE, max_rel_error, needs_triton

# fp32: the sum of squares in another order; bf16: two roundings (to x's dtype before the
# weight, and the output), each a truncation (up to an ulp, 2^-7) in Triton's interpreter
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def engine_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward as the engine computed it before kernels.rms_norm (HF's rounding)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def norm_inputs(shape, dtype=torch.float32, seed: int = 0, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    residual = torch.randn(*shape, generator=gen)
    weight = 1 + torch.randn(shape[-1], generator=gen) * 0.1
    return tuple(t.to(device, dtype) for t in (x, residual, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_is_the_engines_formula_bit_for_bit(dtype):
    x, residual, weight = norm_inputs((63, 100), dtype, device="cpu")
    assert torch.equal(naive_rms_norm(x, weight, 1e-6), engine_rms_norm(x, weight, 1e-6))
    out, new_residual = naive_rms_norm(x, weight, 1e-6, residual)
    # the unfused layer: stream = residual + x (the sum commutes exactly), then the norm
    stream = residual + x
    assert torch.equal(new_residual, stream)
    assert torch.equal(out, engine_rms_norm(stream, weight, 1e-6))


def test_naive_fp32_path_is_the_hf_formula():
    x, _, weight = norm_inputs((63, 60), device="cpu")
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(naive_rms_norm(x, weight, 1e-6), weight * h)


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 63])
@pytest.mark.parametrize("hidden", [60, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_naive(num_tokens, hidden, dtype):
    x, _, weight = norm_inputs((num_tokens, hidden), dtype)
    got = triton_rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    bound = BOUND[dtype]
    assert max_rel_error(got, naive_rms_norm(x, weight, 1e-6)) < bound


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_add_matches_naive(dtype):
    x, residual, weight = norm_inputs((63, 100), dtype)
    out, new_residual = triton_rms_norm(x, weight, 1e-6, residual)
    want_out, want_residual = naive_rms_norm(x, weight, 1e-6, residual)
    bound = BOUND[dtype]
    assert max_rel_error(new_residual, want_residual) < bound
    assert max_rel_error(out, want_out) < bound
    assert not torch.equal(x, new_residual)  # the inputs are left as they were


@needs_triton
def test_triton_normalises_heads_of_a_strided_view():
    # q/k norm: q is a [T, H, D] column slice of the fused projection's output
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(63, 4 + 2 + 2, 60, generator=gen).to(DEVICE)
    q, k, _ = qkv.split([4, 2, 2], dim=1)
    weight = (1 + torch.randn(60, generator=gen) * 0.1).to(DEVICE)
    qg = torch.randn(63, 4, 2 * 60, generator=gen).to(DEVICE)  # Qwen3.5: query | gate per head
    for x in (q, k, qg[..., :60]):
        got = triton_rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        assert max_rel_error(got, naive_rms_norm(x, weight, 1e-6)) < 1e-5


@needs_triton
def test_triton_bf16_input_with_fp32_weight_promotes_like_torch():
    x, _, weight = norm_inputs((5, 60), torch.bfloat16)
    weight = weight.float()
    got, want = triton_rms_norm(x, weight, 1e-6), naive_rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    assert max_rel_error(got, want) < 2e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 256])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_gpu_fused_add_norm_at_real_sizes(num_tokens, hidden):
    x, residual, weight = norm_inputs((num_tokens, hidden), torch.bfloat16, device="cuda")
    out, new_residual = triton_rms_norm(x, weight, 1e-6, residual)
    want_out, want_residual = naive_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, want_residual)  # both round x + r once
    assert max_rel_error(out, want_out) < 1e-2
