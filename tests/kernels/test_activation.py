"""SiLU-and-mul: the naive version against the engine's MLP formula as it was before the
kernel (bit for bit), the Triton one against the naive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.activation import naive_silu_and_mul, triton_silu_and_mul

from . import DEVICE, max_rel_error, needs_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# fp32: exp's last bits; bf16: two roundings (silu, the product), each a truncation (up to
# an ulp, 2^-7) in Triton's interpreter
BOUND = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


def gate_up(num_tokens: int, inter: int, dtype, device=DEVICE, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, 2 * inter, generator=gen) * 4).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_is_the_engines_formula_bit_for_bit(dtype):
    x = gate_up(63, 100, dtype, device="cpu")
    gate, up = x.chunk(2, dim=-1)  # MLP.forward before kernels.silu_and_mul
    assert torch.equal(naive_silu_and_mul(x), F.silu(gate).mul_(up))


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 63])
@pytest.mark.parametrize("inter", [60, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_naive(num_tokens, inter, dtype):
    x = gate_up(num_tokens, inter, dtype)
    got = triton_silu_and_mul(x)
    assert got.shape == (num_tokens, inter) and got.dtype == dtype
    assert max_rel_error(got, naive_silu_and_mul(x)) < BOUND[dtype]


@needs_triton
def test_triton_reads_strided_rows_and_leading_dims():
    wide = gate_up(63, 80, torch.float32)  # rows of 160, of which the first 120 are gate|up
    x = wide[:, :120]
    assert max_rel_error(triton_silu_and_mul(x), naive_silu_and_mul(x)) < 1e-6
    x3 = gate_up(12, 30, torch.float32).view(3, 4, 60)
    got = triton_silu_and_mul(x3)
    assert got.shape == (3, 4, 30)
    assert max_rel_error(got, naive_silu_and_mul(x3)) < 1e-6


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inter", [11008, 17408])
def test_gpu_silu_and_mul_at_real_sizes(inter):
    for num_tokens in (1, 512):
        x = gate_up(num_tokens, inter, torch.bfloat16, device="cuda")
        assert max_rel_error(triton_silu_and_mul(x), naive_silu_and_mul(x)) < 1e-2
