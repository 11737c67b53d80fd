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


@pytest.fixture
def check_every_draft(monkeypatch):
    """Every drafted token is checked: the tests of what a check keeps (exactness, the
    sampled distribution, rollback) do not depend on what the draft policy measures on a
    busy machine (spec/policy.py has tests of its own, and one through the engine)."""
    from helexa.engine.spec.policy import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "choose", lambda self, base, drafts: [k for _, k in drafts])
