"""A real device fault on demand, for recovery tests (HELEXA_DEBUG_POISON on a CUDA node).

One Triton program stores far past the end of a one-element tensor: an illegal address.
CUDA makes that fault sticky, so every later call on the context fails, exactly as after
a real kernel bug or a bad memory read. No naive twin: there is nothing to compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WILD_OFFSET = 1 << 40  # elements past the tensor: ~4 TiB, never mapped


@triton.jit
def _wild_store_kernel(ptr, offset):
    tl.store(ptr + offset, 1.0)


def triton_illegal_address(device: torch.device) -> None:
    """Launch a kernel that writes to an unmapped address of `device` (CUDA only). The
    fault shows at the next synchronization."""
    if device.type != "cuda":
        raise ValueError("an illegal-address fault needs a CUDA device")
    target = torch.zeros(1, dtype=torch.float32, device=device)
    _wild_store_kernel[(1,)](target, WILD_OFFSET)
