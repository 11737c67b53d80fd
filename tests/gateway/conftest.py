"""The gateway tests use the model fixtures of tests/conftest.py (tests/model_fixtures.py),
and a fresh database built by the migrations."""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa.db.session import make_engine, session_factory, upgrade


@pytest.fixture
def sessions(tmp_path: Path):
    """Sessions on a new SQLite file at the migrations' head."""
    url = f"sqlite:///{tmp_path / 'helexa.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()
