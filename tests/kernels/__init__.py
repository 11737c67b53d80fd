"""Kernel tests: each triton_* against its naive_* twin, and the naive ones against HF.

Without CUDA the Triton kernels run in Triton's interpreter, which triton reads when it is
imported (its own jit helpers, tl.sigmoid, tl.sum, ...) and when each kernel is defined. So
TRITON_INTERPRET is set here, before these tests import triton; if something imported triton
earlier in this process (transformers' Qwen3.5 modules do), only the environment of the
pytest run can fix it, and the Triton tests fail saying so.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None

interpreter_too_late = False
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    interpreter_too_late = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


def needs_triton(test: Callable) -> Callable:
    """Skipped without triton; failed, with the fix, when triton was imported before the
    interpreter could be asked for."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if interpreter_too_late:
            pytest.fail(
                "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot "
                "run on CPU in this process: run pytest with TRITON_INTERPRET=1 in its "
                "environment (or set it before anything imports triton)"
            )
        return test(*args, **kwargs)

    return pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")(run)


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: relative to the tensor's scale, not each element's, so
    that elements near zero (where any rounding is a large relative change) do not dominate."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
