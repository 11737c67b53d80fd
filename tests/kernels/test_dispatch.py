"""The dispatcher: naive on CPU, Triton on CUDA, and set_backend overriding that."""

from __future__ import annotations

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels.fused_moe import naive_fused_moe
from helexa.kernels.gdn_gating import naive_gdn_gating

from . import max_rel_error, needs_triton
from .test_fused_moe import MatmulRows


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def test_cpu_tensors_take_the_naive_path_by_default():
    assert kernels.backend() == "auto"
    assert not kernels.uses_triton(torch.zeros(1))
    a = torch.randn(5, 3)
    g, beta = kernels.gdn_gating(torch.zeros(3), a, a, torch.zeros(3))
    want_g, want_beta = naive_gdn_gating(torch.zeros(3), a, a, torch.zeros(3))
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(beta, want_beta)


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'cuda'.*auto"):
        kernels.set_backend("cuda")


def test_naive_backend_keeps_even_cuda_tensors_on_torch():
    kernels.set_backend("naive")
    assert kernels.backend() == "naive"
    assert not kernels.uses_triton(torch.zeros(1))


@needs_triton
def test_triton_backend_runs_the_triton_kernels_on_cpu_through_the_interpreter():
    kernels.set_backend("triton")
    assert kernels.uses_triton(torch.zeros(1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(63, 60, generator=gen)
    w13 = torch.randn(6, 80, 60, generator=gen) / 8
    w2 = torch.randn(6, 60, 40, generator=gen) / 8
    weights, ids = torch.randn(63, 6, generator=gen).softmax(-1).topk(2, dim=-1)
    with MatmulRows() as mode:  # the naive path would run its matmuls through torch
        out = kernels.fused_moe(x, w13, w2, weights, ids)
    assert mode.calls == []
    assert max_rel_error(out, naive_fused_moe(x, w13, w2, weights, ids)) < 1e-4
