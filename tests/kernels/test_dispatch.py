"""The dispatcher: naive on CPU, Triton on CUDA, and set_backend overriding that."""

from __future__ import annotations

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels.gdn_gating import naive_gdn_gating


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
