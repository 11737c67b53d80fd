"""Quantized weights: the GGUF repacking against the loader's dequantization, quantize()'s
round trips, and the Triton kernels (GEMV and GEMM, every kind) against naive_quant_matmul."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import helexa.kernels as kernels
from helexa.engine.loader.dequant import dequantize
from helexa.kernels.quant_matmul import (
    GGUF_KINDS,
    QUANT_KINDS,
    QuantWeight,
    cat_rows,
    check_shape,
    gguf_nbytes,
    make_gguf_blocks,
    naive_dequantize,
    naive_quant_matmul,
    pack_gguf,
    quantize,
    triton_quant_matmul,
    unsupported_reason,
)

from . import DEVICE, max_rel_error, needs_triton

# quant_pack's bytes against GGUF's: the k-quants' 6-bit scales and mins are unpacked to bytes
NBYTES_RATIO = {"Q4_0": 1.0, "Q4_1": 1.0, "Q8_0": 1.0, "Q4_K": 148 / 144, "Q5_K": 180 / 176}
NBYTES_RATIO["Q6_K"] = 1.0
# Triton against naive: the GEMV sums in fp32 from exact fp32 weights; the GEMM dots bf16
# weights (on a GPU) in fp32; both round the output to bf16 once (Triton's interpreter
# truncates: up to one ulp, 2^-7)
RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def gguf_weight(kind: str, out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, QuantWeight]:
    gen = torch.Generator().manual_seed(seed)
    raw = make_gguf_blocks(kind, out, inp, generator=gen)
    return raw, pack_gguf(raw, kind, (out, inp))


def any_weight(kind: str, out: int, inp: int, seed: int = 0) -> QuantWeight:
    if kind in GGUF_KINDS:
        return gguf_weight(kind, out, inp, seed)[1]
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.02
    return quantize(w, kind)


# -- layouts -------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(40, 256), (100, 512), (1, 768)])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_repacked_gguf_dequantizes_exactly_as_the_loader_does(kind, shape):
    raw, qw = gguf_weight(kind, *shape)
    assert (qw.kind, qw.out_features, qw.in_features) == (kind, *shape)
    want = dequantize(raw, kind, shape)
    got = naive_dequantize(qw)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_repacked_gguf_stays_within_three_percent_of_the_gguf_bytes(kind):
    raw, qw = gguf_weight(kind, 40, 512)
    assert raw.nbytes == gguf_nbytes(kind, (40, 512))
    assert qw.nbytes <= 1.03 * raw.nbytes
    assert qw.nbytes / raw.nbytes == pytest.approx(NBYTES_RATIO[kind])
    # every tensor is [out, ...]: rows are output channels
    assert all(t.shape[0] == 40 and t.is_contiguous() for t in qw.tensors)


def test_bits_per_weight_of_each_kind():
    bits = {kind: any_weight(kind, 16, 512).bits_per_weight for kind in QUANT_KINDS}
    assert bits == {
        "Q4_0": 4.5,
        "Q4_1": 5.0,
        "Q8_0": 8.5,
        "Q4_K": 4.625,
        "Q5_K": 5.625,
        "Q6_K": 6.5625,
        "int8": 8 + 32 / 512,  # one fp32 scale per row
        "int4": 5.0,
        "fp8": 8 + 32 / 512,
        "int4_zp": 4.75,  # f16 scale and u8 zero point per 32
        "fp8_block": 9.0,  # an f32 scale per 32 (its 128 x 128 block's)
    }


def test_pack_gguf_refuses_wrong_sizes_and_types():
    raw, _ = gguf_weight("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="needs"):
        pack_gguf(raw[:, :-1], "Q4_K", (4, 256))
    with pytest.raises(ValueError, match="multiple of 256"):
        pack_gguf(raw, "Q4_K", (8, 128))
    with pytest.raises(ValueError, match="pack_gguf takes"):
        pack_gguf(raw, "F16", (4, 256))


def test_pack_gguf_works_on_a_view_of_the_bytes():
    # GGUF tensors of stacked experts are sliced by rows before packing
    raw, _ = gguf_weight("Q5_K", 12, 256)
    qw = pack_gguf(raw[4:8], "Q5_K", (4, 256))
    assert torch.equal(naive_dequantize(qw), dequantize(raw, "Q5_K", (12, 256))[4:8])


def test_check_shape_names_the_block():
    assert check_shape("Q4_K", (40, 512)) is None
    assert check_shape("Q4_0", (3, 96)) is None
    assert "multiple of 256" in check_shape("Q6_K", (40, 96))
    assert "multiple of 32" in check_shape("int8", (40, 100))
    assert "unknown quant kind" in check_shape("Q2_K", (40, 256))
    assert "[out_features, in_features]" in check_shape("int4", (2, 3, 32))


def test_unsupported_reason():
    for kind in QUANT_KINDS:  # fp8 too: its bits are decoded with integer ops
        assert unsupported_reason(kind, "cpu") is None
    assert "unknown quant kind" in unsupported_reason("nf4", "cpu")


def test_to_and_cat_rows_keep_every_tensor():
    a, b = any_weight("Q6_K", 8, 256, seed=1), any_weight("Q6_K", 24, 256, seed=2)
    both = cat_rows([a, b.to("cpu")])
    assert (both.out_features, both.nbytes) == (32, a.nbytes + b.nbytes)
    want = torch.cat([naive_dequantize(a), naive_dequantize(b)])
    assert torch.equal(naive_dequantize(both), want)
    with pytest.raises(ValueError, match="one kind"):
        cat_rows([a, any_weight("Q4_K", 8, 256)])


# -- quantize ------------------------------------------------------------------------
def round_trip(kind: str, w: torch.Tensor) -> tuple[QuantWeight, torch.Tensor]:
    qw = quantize(w, kind)
    assert (qw.kind, qw.out_features, qw.in_features) == (kind, *w.shape)
    return qw, naive_dequantize(qw)


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    qw, back = round_trip("int8", w)
    assert qw.qs.dtype == torch.int8 and qw.scales.shape == (48,)
    assert ((back - w).abs() <= qw.scales[:, None] * 0.5001).all()
    assert (back - w).norm() / w.norm() < 0.012


def test_int4_round_trip_is_within_half_a_step_per_group():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    qw, back = round_trip("int4", w)
    step = qw.scales.float().repeat_interleave(32, dim=1)
    # half a step, plus what rounding the group's min to fp16 moves
    assert ((back - w).abs() <= 0.5 * step + 1e-3 * w.abs().amax()).all()
    assert (back - w).norm() / w.norm() < 0.1


def test_fp8_round_trip_is_within_e4m3_rounding():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    qw, back = round_trip("fp8", w)
    assert qw.qs.dtype == torch.uint8 and qw.scales.dtype == torch.float32
    # half a unit of a 3-bit mantissa (2^-4 relative), or of the subnormal step (2^-10 * s)
    bound = torch.maximum(w.abs() * 2**-4, qw.scales[:, None] * 2**-10)
    assert ((back - w).abs() <= bound * 1.0001).all()
    assert (back - w).norm() / w.norm() < 0.04


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quantize_keeps_zeros_and_constant_groups_exact(kind):
    w = torch.zeros(3, 64)
    w[1] = 0.5
    w[2, :32] = -0.25
    assert torch.equal(naive_dequantize(quantize(w, kind)), w)


def test_quantize_refuses_gguf_kinds_and_odd_shapes():
    with pytest.raises(ValueError, match="int8, int4 or fp8"):
        quantize(torch.zeros(4, 32), "Q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), "int4")


# -- make_gguf_blocks ----------------------------------------------------------------
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_random_gguf_blocks_are_valid_weights_of_a_trained_scale(kind):
    raw = make_gguf_blocks(kind, 64, 512, generator=torch.Generator().manual_seed(3))
    assert raw.dtype == torch.uint8 and raw.shape == (64, gguf_nbytes(kind, (64, 512)) // 64)
    w = dequantize(raw, kind, (64, 512))
    assert torch.isfinite(w).all()
    assert 0.015 < w.std().item() < 0.03
    assert abs(w.mean().item()) < 0.005
    again = make_gguf_blocks(kind, 64, 512, generator=torch.Generator().manual_seed(3))
    assert torch.equal(raw, again)


# -- Triton against naive --------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_triton_matches_naive_in_bf16(kind, rows):
    gen = torch.Generator().manual_seed(rows)
    qw = any_weight(kind, 40, 512).to(DEVICE)
    x = torch.randn(rows, 512, generator=gen).to(DEVICE, torch.bfloat16)
    bias = (torch.randn(40, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    got = triton_quant_matmul(x, qw, bias)
    want = naive_quant_matmul(x, qw, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    assert max_rel_error(got, want) < RTOL[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize(("kind", "dtype"), [("Q4_K", torch.float32), ("Q6_K", torch.float16)])
def test_triton_matches_naive_in_fp32_and_fp16(kind, dtype, gemv):
    gen = torch.Generator().manual_seed(0)
    qw = any_weight(kind, 100, 256).to(DEVICE)
    x = torch.randn(7, 256, generator=gen).to(DEVICE, dtype)
    got = triton_quant_matmul(x, qw, gemv=gemv)
    assert got.dtype == dtype
    assert max_rel_error(got, naive_quant_matmul(x, qw)) < RTOL[dtype]


@needs_triton
@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("kind", ["Q4_0", "Q5_K", "fp8"])
def test_small_tiles_split_k_and_partial_steps(kind, gemv):
    # K = 768 in steps of 64 (GEMV) or 32 (GEMM): many steps; the GEMM split in 3 with a bias
    # (added once, after the partial sums); Q4_0 and fp8 at K = 96 leave the last step part
    # empty. The GEMV never splits K.
    k = 96 if kind != "Q5_K" else 768
    gen = torch.Generator().manual_seed(1)
    qw = any_weight(kind, 40, k).to(DEVICE)
    x = torch.randn(3 if gemv else 20, k, generator=gen).to(DEVICE)
    bias = torch.randn(40, generator=gen).to(DEVICE)
    want = naive_quant_matmul(x, qw, bias)
    for split_k in (1,) if gemv else (1, 3):
        got = triton_quant_matmul(
            x, qw, bias, gemv=gemv, block_m=16, block_n=16, block_k=64 if gemv else 32,
            split_k=split_k,
        )  # fmt: skip
        assert max_rel_error(got, want) < RTOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_gemv_matches_naive_for_every_kind_at_one_to_eight_rows(kind, dtype):
    # N = 37: no row tile divides it; K = 768: three super-blocks, 24 groups (48 for Q6_K),
    # in the default plan's one step, or in two of 512 weights the last of which is half empty
    qw = any_weight(kind, 37, 768, seed=3).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(37, generator=gen).to(DEVICE, dtype)
    for rows in range(1, 9):
        x = torch.randn(rows, 768, generator=gen).to(DEVICE, dtype)
        tiles = {} if rows % 2 else {"block_n": 8, "block_k": 512}
        got = triton_quant_matmul(x, qw, bias if rows != 4 else None, gemv=True, **tiles)
        want = naive_quant_matmul(x, qw, bias if rows != 4 else None)
        assert got.dtype == dtype and got.shape == (rows, 37)
        assert max_rel_error(got, want) < RTOL[dtype], rows


class KernelSpy:
    """Stands in for a Triton kernel: records each launch's grid, and runs nothing."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.grids.append(grid)


class AtenOps(TorchDispatchMode):
    """The names of the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@needs_triton
@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.bfloat16), (8, torch.float32)])
def test_the_gemv_is_one_launch_that_writes_the_output_and_nothing_runs_after_it(
    monkeypatch, rows, dtype
):
    # the kernel itself is a spy (Triton's interpreter copies tensors through torch): what is
    # left is the launcher's own torch work, which must be the output's allocation alone, no
    # split-K partials summed, no cast, no bias added (that the kernel writes the right output
    # is the tests above)
    qm = importlib.import_module("helexa.kernels.quant_matmul")
    monkeypatch.setattr(qm, "_quant_gemv_kernel", spy := KernelSpy())
    qw = any_weight("Q4_K", 4096, 256).to(DEVICE)  # 4096 rows: a row tile of 8 on CPU plans
    x = torch.randn(rows, 256).to(DEVICE, dtype)
    bias = torch.randn(4096).to(DEVICE, dtype)
    with AtenOps() as ops:
        y = triton_quant_matmul(x, qw, bias)
    assert len(spy.grids) == 1 and len(spy.grids[0]) == 1  # rows of W only: no split of K
    assert y.shape == (rows, 4096) and y.dtype == dtype
    assert sorted(set(ops.names)) == ["empty", "view"] and ops.names.count("empty") == 1


@needs_triton
def test_triton_takes_leading_dims_strided_rows_and_no_rows():
    qw = any_weight("Q8_0", 24, 64).to(DEVICE)
    wide = torch.randn(2, 3, 100, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x = wide[..., 10:74]  # rows 100 apart
    got = triton_quant_matmul(x, qw)
    assert got.shape == (2, 3, 24)
    assert max_rel_error(got, naive_quant_matmul(x, qw)) < RTOL[torch.float32]
    assert triton_quant_matmul(x[:, :0], qw).shape == (2, 0, 24)
    with pytest.raises(ValueError, match="features"):
        triton_quant_matmul(wide, qw)


@needs_triton
def test_the_dispatcher_routes_by_device_and_backend():
    qw = any_weight("int4", 16, 64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    want = naive_quant_matmul(x, qw)
    assert torch.equal(kernels.quant_matmul(x, qw), want)  # CPU: naive
    kernels.set_backend("triton")
    try:
        assert max_rel_error(kernels.quant_matmul(x, qw), want) < RTOL[torch.float32]
    finally:
        kernels.set_backend("auto")


# -- on a GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_cuda_kernels_at_qwen3_8b_shapes(kind):
    # Qwen3-8B's gate/up projection: 4096 -> 12288; decode and prefill row counts
    qw = any_weight(kind, 12288, 4096).to("cuda")
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 4, 8, 16, 100, 512):
        x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
        got = triton_quant_matmul(x, qw)
        want = naive_quant_matmul(x, qw)
        assert max_rel_error(got, want) < RTOL[torch.bfloat16], rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
def test_cuda_kernels_replay_in_a_cuda_graph(rows):
    # 4096 <- 12288 (the down projection): the GEMV walks all of K in each program
    qw = any_weight("Q4_K", 4096, 12288).to("cuda")
    x = torch.randn(rows, 12288, device="cuda", dtype=torch.bfloat16)
    triton_quant_matmul(x, qw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_quant_matmul(x, qw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert max_rel_error(y, naive_quant_matmul(x, qw)) < RTOL[torch.bfloat16]
