"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest

from helexa.engine.layers import native


@pytest.fixture(scope="session")
def scalar(tmp_path_factory):
    """The native kernels (blocks.c, kquants.c) built for x86-64 without AVX2 (their #else
    loops), once, outside the cache."""
    if not native.available():
        pytest.skip("no C compiler here")
    flags = (*(f for f in native.FLAGS if not f.startswith("-march")), "-march=x86-64")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELEXA_NATIVE_DIR", str(tmp_path_factory.mktemp("scalar")))
        return native.load(native.build(native._compiler(), flags))
