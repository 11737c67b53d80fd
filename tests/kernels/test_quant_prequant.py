"""The pre-quantized checkpoints' kinds: int4_zp (AWQ, GPTQ) and fp8_block (fp8 with block
scales), packed from a file's groups and blocks, against a plain reference, and their Triton
kernels against naive_quant_matmul at awkward sizes."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels.quant_matmul import (
    naive_dequantize,
    naive_quant_matmul,
    pack_fp8_blocks,
    pack_zero_point,
    triton_quant_matmul,
)

from . import DEVICE, max_rel_error, needs_triton

RTOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # as test_quant_matmul's


def zero_point_weight(out: int, inp: int, group: int, seed: int = 0):
    """Random codes, fp16 scales and zeros 0..16 (GPTQ v1's z can be 16) per `group` inputs,
    and w = (q - z) * s computed element by element."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=gen)
    zeros = torch.randint(0, 17, (out, inp // group), generator=gen)
    scales = (torch.rand(out, inp // group, generator=gen) * 0.01 + 1e-3).half()
    w = torch.empty(out, inp)
    for j in range(inp):
        w[:, j] = (codes[:, j] - zeros[:, j // group]).float() * scales[:, j // group].float()
    return codes, scales, zeros, w


def fp8_block_weight(out: int, inp: int, block: tuple[int, int], seed: int = 0):
    """Random e4m3 values with one fp32 scale per block (edge blocks short), and w."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(out, inp, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    bn, bk = block
    scale = torch.rand(-(-out // bn), -(-inp // bk), generator=gen) * 1e-3 + 1e-5
    w = torch.empty(out, inp)
    for i in range(out):
        for j in range(0, inp, 32):  # bk is a multiple of 32: a run of 32 is in one block
            w[i, j : j + 32] = q[i, j : j + 32].float() * scale[i // bn, j // bk]
    return q, scale, w


@pytest.mark.parametrize(("out", "inp", "group"), [(40, 256, 128), (24, 96, 32), (8, 192, 64)])
def test_zero_point_weights_dequantize_exactly(out, inp, group):
    codes, scales, zeros, w = zero_point_weight(out, inp, group)
    qw = pack_zero_point(codes, scales, zeros)
    assert (qw.kind, qw.out_features, qw.in_features) == ("int4_zp", out, inp)
    assert qw.scales.shape == qw.mins.shape == (out, inp // 32)
    assert torch.equal(naive_dequantize(qw), w)


@pytest.mark.parametrize(
    ("out", "inp", "block"), [(200, 160, (128, 128)), (40, 96, (1, 32)), (130, 256, (64, 256))]
)
def test_fp8_block_weights_dequantize_exactly(out, inp, block):
    q, scale, w = fp8_block_weight(out, inp, block)
    qw = pack_fp8_blocks(q, scale, block)
    assert (qw.kind, qw.scales.shape) == ("fp8_block", (out, inp // 32))
    assert torch.equal(naive_dequantize(qw), w)


def test_packing_refuses_groups_that_split_the_kernels_32s():
    codes, scales, zeros, _ = zero_point_weight(8, 96, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_zero_point(codes, scales[:, :2], zeros[:, :2])  # groups of 48
    q, scale, _ = fp8_block_weight(8, 96, (8, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_fp8_blocks(q, scale[:, :2], (8, 48))


@needs_triton
@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("kind", ["int4_zp", "fp8_block"])
def test_triton_matches_naive_at_awkward_sizes(kind, gemv):
    # N = 40, K = 160: five groups of 32, the last GEMM step half empty; split-K of 3
    if kind == "int4_zp":
        codes, scales, zeros, _ = zero_point_weight(40, 160, 32, seed=1)
        qw = pack_zero_point(codes, scales, zeros)
    else:
        q, scale, _ = fp8_block_weight(40, 160, (16, 64), seed=1)
        qw = pack_fp8_blocks(q, scale, (16, 64))
    qw = qw.to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3 if gemv else 21, 160, generator=gen).to(DEVICE)
    bias = torch.randn(40, generator=gen).to(DEVICE)
    want = naive_quant_matmul(x, qw, bias)
    for split_k in (1,) if gemv else (1, 3):  # the GEMV walks all of K: no split
        got = triton_quant_matmul(
            x, qw, bias, gemv=gemv, block_m=16, block_n=16, block_k=64, split_k=split_k
        )
        assert max_rel_error(got, want) < RTOL[torch.float32]
    x16 = x.to(torch.bfloat16)
    got = triton_quant_matmul(x16, qw, gemv=gemv)
    assert max_rel_error(got, naive_quant_matmul(x16, qw)) < RTOL[torch.bfloat16]
