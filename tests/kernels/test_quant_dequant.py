"""The dense prefill path: triton_dequantize against naive_dequantize (every kind, bit for bit),
dense_quant_matmul and its scratch, quant_matmul's dispatch to it, and its benchmark's
refusal without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels import quant_dequant
from helexa.kernels.quant_dequant import (
    DENSE_MIN_M,
    dense_quant_matmul,
    scratch_bytes,
    triton_dequantize,
)
from helexa.kernels.quant_matmul import (
    QUANT_KINDS,
    naive_dequantize,
    naive_quant_matmul,
    pack_zero_point,
    triton_quant_matmul,
)

from . import DEVICE, max_rel_error, needs_triton
from .test_quant_matmul import RTOL, any_weight

BENCH = Path(__file__).parents[2] / "bench" / "quant_prefill.py"


@pytest.fixture
def fresh_scratch(monkeypatch):
    """An empty scratch for the test, the process's own back afterwards."""
    monkeypatch.setattr(quant_dequant, "_scratch", {})


@pytest.fixture
def triton_backend():
    kernels.set_backend("triton")
    yield
    kernels.set_backend("auto")


# -- triton_dequantize -----------------------------------------------------------------------
# N not a multiple of block_n (16); K of several super-blocks and several tiles, the last one
# partial at (7, 768, 512)
@pytest.mark.parametrize("shape", [(40, 512, 128), (7, 768, 512)])
@pytest.mark.parametrize("kind", QUANT_KINDS)
@needs_triton
def test_dequantize_equals_naive_in_fp32_and_rounds_as_it_does_in_bf16_and_fp16(kind, shape):
    n, k, block_k = shape
    qw = any_weight(kind, n, k, seed=n).to(DEVICE)
    want = naive_dequantize(qw)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = triton_dequantize(qw, dtype=dtype, block_k=block_k)
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype)), dtype


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@needs_triton
def test_zero_point_weights_with_a_checkpoints_wider_scales_dequantize_exactly(scale_dtype):
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (24, 256), generator=gen)
    scales = (torch.rand(24, 2, generator=gen) * 0.01).to(scale_dtype)  # groups of 128
    qw = pack_zero_point(codes, scales, torch.randint(0, 17, (24, 2), generator=gen))
    assert torch.equal(triton_dequantize(qw.to(DEVICE), dtype=torch.float32).cpu(),
                       naive_dequantize(qw))  # fmt: skip


@needs_triton
def test_dequantize_writes_into_a_given_buffer_with_wider_rows_and_nothing_past_them():
    qw = any_weight("Q5_K", 20, 256).to(DEVICE)
    buf = torch.full((20, 300), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = triton_dequantize(qw, buf[:, :256], block_k=64)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, :256], naive_dequantize(qw).bfloat16())
    assert bool((buf[:, 256:] == 7.0).all())


@needs_triton
def test_dequantize_refuses_a_wrong_buffer_or_tile():
    qw = any_weight("Q4_0", 8, 64)
    with pytest.raises(ValueError, match=r"\[8, 64\]"):
        triton_dequantize(qw, torch.empty(8, 32))
    with pytest.raises(ValueError, match="float64"):
        triton_dequantize(qw, torch.empty(8, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of Q4_0's 32"):
        triton_dequantize(qw, block_k=48)


# -- dense_quant_matmul ------------------------------------------------------------------
@pytest.mark.parametrize("kind", QUANT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_triton
def test_dense_matmul_matches_naive(kind, dtype, fresh_scratch):
    qw = any_weight(kind, 48, 256).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 256, generator=gen).to(DEVICE, dtype)  # leading dims: 15 rows
    bias = torch.randn(48, generator=gen).to(DEVICE, dtype)
    got = dense_quant_matmul(x, qw, bias)
    assert got.shape == (3, 5, 48) and got.dtype == dtype
    assert max_rel_error(got, naive_quant_matmul(x, qw, bias)) < RTOL[dtype]


@needs_triton
def test_the_scratch_is_reused_for_a_smaller_weight_and_grown_for_a_bigger_one(fresh_scratch):
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEVICE)
    dense_quant_matmul(x, any_weight("Q4_K", 64, 256).to(DEVICE))
    (first,) = quant_dequant._scratch.values()
    assert scratch_bytes() == 64 * 256 * 2
    small = any_weight("Q8_0", 16, 256).to(DEVICE)
    y = dense_quant_matmul(x, small)
    assert quant_dequant._scratch[(x.device, x.dtype)] is first  # no new buffer
    assert max_rel_error(y, naive_quant_matmul(x, small)) < RTOL[torch.bfloat16]
    big = any_weight("Q6_K", 96, 512).to(DEVICE)
    y = dense_quant_matmul(torch.randn(4, 512, dtype=torch.bfloat16, device=DEVICE), big)
    assert scratch_bytes() == 96 * 512 * 2  # grown, the old one dropped
    # one scratch per dtype
    dense_quant_matmul(x.float(), small)
    assert scratch_bytes() == 96 * 512 * 2 + 16 * 256 * 4


@needs_triton
def test_a_weight_past_the_cap_runs_in_row_chunks_that_fit(fresh_scratch, monkeypatch):
    monkeypatch.setattr(quant_dequant, "DENSE_SCRATCH_MAX_BYTES", 16 * 256 * 2)
    qw = any_weight("int4", 40, 256).to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 256, generator=gen).to(DEVICE, torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(DEVICE, torch.bfloat16)
    got = dense_quant_matmul(x, qw, bias)
    assert scratch_bytes() == 14 * 256 * 2  # 3 balanced chunks of 14, 14 and 12 rows
    assert max_rel_error(got, naive_quant_matmul(x, qw, bias)) < RTOL[torch.bfloat16]


# -- quant_matmul's dispatch -------------------------------------------------------------------
class Spy:
    """Counts the calls of a function it stands in for, and calls it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@needs_triton
def test_quant_matmul_takes_the_dense_path_from_dense_min_m_rows_on_triton(
    triton_backend, fresh_scratch, monkeypatch
):
    dense = Spy(dense_quant_matmul)
    monkeypatch.setattr(quant_dequant, "dense_quant_matmul", dense)
    monkeypatch.setattr(kernels, "triton_quant_matmul", fused := Spy(kernels.triton_quant_matmul))
    qw = any_weight("Q4_K", 24, 256).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(DENSE_MIN_M, 256, generator=gen).to(DEVICE, torch.bfloat16)
    for rows in (x, x.reshape(2, DENSE_MIN_M // 2, 256)):  # leading dims count as rows
        got = kernels.quant_matmul(rows, qw)
        assert max_rel_error(got, naive_quant_matmul(rows, qw)) < RTOL[torch.bfloat16]
    assert (dense.calls, fused.calls) == (2, 0)
    fewer = x[: DENSE_MIN_M - 1]
    got = kernels.quant_matmul(fewer, qw)
    assert (dense.calls, fused.calls) == (2, 1)
    assert max_rel_error(got, naive_quant_matmul(fewer, qw)) < RTOL[torch.bfloat16]


@needs_triton
def test_a_call_under_graph_capture_keeps_the_fused_kernels_at_any_rows(
    triton_backend, monkeypatch
):
    # decode graphs are captured for up to 512 rows; the scratch must stay out of them
    monkeypatch.setattr(quant_dequant, "capturing", lambda x: True)
    monkeypatch.setattr(quant_dequant, "dense_quant_matmul", dense := Spy(dense_quant_matmul))
    qw = any_weight("fp8", 16, 64).to(DEVICE)
    x = torch.randn(DENSE_MIN_M, 64, device=DEVICE)
    assert max_rel_error(kernels.quant_matmul(x, qw), naive_quant_matmul(x, qw)) < 1e-5
    assert dense.calls == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's default backend")
def test_cpu_tensors_keep_the_naive_path_at_any_rows(monkeypatch):
    monkeypatch.setattr(quant_dequant, "dense_quant_matmul", dense := Spy(dense_quant_matmul))
    qw = any_weight("Q8_0", 8, 64)
    x = torch.randn(DENSE_MIN_M, 64)
    assert torch.equal(kernels.quant_matmul(x, qw), naive_quant_matmul(x, qw))
    assert dense.calls == 0


# -- the benchmark -----------------------------------------------------------------------------
def load_bench():
    spec = importlib.util.spec_from_file_location("bench_quant_prefill", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_counts_tflops_and_rotates_weights_past_l2():
    bench = load_bench()
    assert bench.tflops(512, 12288, 4096, 1e-3) == pytest.approx(51.54, abs=0.01)
    assert bench.num_copies(29 << 20) == 8  # Q4_K 4096 x 12288: capped
    assert bench.num_copies(300 << 20) == 1
    assert bench.parse_list("512, 4096", range(1, 8192), int) == [512, 4096]
    with pytest.raises(ValueError, match="Q4_K"):
        bench.parse_list("Q2_K", bench.KINDS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_the_benchmark_refuses_to_run_without_cuda(capsys):
    assert load_bench().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# -- on a GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_cuda_dense_path_at_qwen3_8b_shapes(kind):
    qw = any_weight(kind, 12288, 4096).to("cuda")
    assert torch.equal(triton_dequantize(qw), naive_dequantize(qw).bfloat16())
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    assert max_rel_error(dense_quant_matmul(x, qw), naive_quant_matmul(x, qw)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_of_many_rows_captures_the_fused_kernel():
    qw = any_weight("Q4_K", 256, 256).to("cuda")
    x = torch.randn(DENSE_MIN_M, 256, device="cuda", dtype=torch.bfloat16)
    kernels.quant_matmul(x, qw)  # compile outside the capture
    triton_quant_matmul(x, qw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.quant_matmul(x, qw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert max_rel_error(y, naive_quant_matmul(x, qw)) < 2e-2
    with pytest.raises(AssertionError, match="capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        dense_quant_matmul(x, qw)
