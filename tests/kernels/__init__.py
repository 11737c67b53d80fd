"""Kernel tests: each triton_* against its naive_* twin, and the naive ones against HF.

Without CUDA the Triton kernels run in Triton's interpreter. triton.jit picks the
interpreter when a kernel is *defined*, so TRITON_INTERPRET is set here, before the kernel
modules are imported; a kernel module that an earlier test already imported (the model code
imports the dispatcher) is executed again so that its kernels are redefined interpreted.
Functions held from before still work: a reload reuses the module's namespace.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# naive tests run anywhere; the Triton ones need triton (a test dependency)
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

KERNEL_MODULES = (
    "helexa.kernels.causal_conv1d",
    "helexa.kernels.gdn_gating",
    "helexa.kernels.fused_moe",
    "helexa.kernels.gated_delta_rule",
)

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in KERNEL_MODULES:
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: relative to the tensor's scale, not each element's, so
    that elements near zero (where any rounding is a large relative change) do not dominate."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
