"""`python -m helexa.kernels.selftest`: every kernel against its twin, one line each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helexa.kernels.selftest import KERNELS

from . import needs_triton


def selftest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "helexa.kernels.selftest", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@needs_triton
def test_selftest_passes_every_kernel_on_this_machine():
    # as a user runs it: without TRITON_INTERPRET, which it sets itself where there is no GPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = selftest(env=env)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) == len(KERNELS)
    assert all(line.endswith(" ok") for line in lines), run.stdout
    names = [line.split()[0] for line in lines]
    assert names == list(KERNELS)  # every kernel, in the order the selftest lists them


@needs_triton
def test_selftest_fails_when_one_kernel_is_off_by_a_percent():
    # two kernels, not all (the test above runs every one): the spoiled one fails alone
    run = selftest("--only", "fused_moe,rms_norm", "--perturb", "fused_moe")
    assert run.returncode == 1
    verdicts = {line.split()[0]: line.split()[-1] for line in run.stdout.splitlines()}
    assert verdicts == {"rms_norm": "ok", "fused_moe": "FAIL"}


def test_selftest_refuses_a_kernel_it_does_not_know():
    run = selftest("--only", "rms_norm,no_such_kernel")
    assert run.returncode == 2
    assert "unknown kernel(s) no_such_kernel" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_selftest_refuses_a_device_torch_cannot_see():
    run = selftest("--device", "cuda")
    assert run.returncode == 2
    assert "no CUDA device" in run.stderr
