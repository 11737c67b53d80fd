"""Build information for the node's `/version` route: the package's (helexa/version.py)
plus the versions of the runtime that does inference."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import torch

import helexa
from helexa import version


def build_info() -> dict[str, Any]:
    """The node's `/version` body: package, git and runtime versions."""
    return {**version.build_info(), **_runtime()}


def engine_versions() -> dict[str, str | None]:
    """Versions of the pieces that run inference: helexa, torch, its CUDA, Triton."""
    return {"helexa": helexa.__version__, **_runtime()}


def _runtime() -> dict[str, str | None]:
    return {
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "triton": triton_version(),
    }


@functools.cache
def triton_version() -> str | None:
    """The installed Triton version, or None where Triton is absent (CPU hosts)."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
