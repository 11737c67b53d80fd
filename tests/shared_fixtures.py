"""Where the shared fixtures live, and what a test does without them: it skips, except under
CI (the CI variable set, as .ci/run sets it), where it fails, as the PostgreSQL and packaging
tests do: CI copies shared/ beside its clone, so a missing fixture there is a broken run.

The shared folder is `$HELEXA_SHARED` when set, else `<repo>/shared` (git-ignored: where only
the checkout travels, as to a GPU host, scripts/gpu-check), else `<repo>/../shared`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]


def _shared_dir() -> Path:
    if os.environ.get("HELEXA_SHARED"):
        return Path(os.environ["HELEXA_SHARED"]).resolve()
    inside = _REPO / "shared"
    if (inside / "fixtures").is_dir():
        return inside
    return (_REPO / ".." / "shared").resolve()


SHARED_DIR = _shared_dir()
FIXTURES_DIR = SHARED_DIR / "fixtures"
FIXTURE_MODELS = FIXTURES_DIR / "models"  # real upstream configs, tokenizers and templates
TRAFFIC_DIR = FIXTURES_DIR / "traffic"  # captured client requests, one JSON file each


def need_shared(path: Path = FIXTURE_MODELS) -> Path:
    """`path`, a shared fixture; without it the test skips, and under CI fails."""
    if path.exists():
        return path
    why = f"shared fixture {path} absent (shared/ beside the checkout, or $HELEXA_SHARED)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run every test: {why}", pytrace=False)
    pytest.skip(why)


def captures(kind: str) -> list[Path]:
    """The captured requests in traffic/`kind`, sorted, to parametrize over; with none, one
    missing path in their place, which the test's `need_shared` skips (under CI, fails)."""
    return sorted((TRAFFIC_DIR / kind).glob("*.json")) or [TRAFFIC_DIR / kind / "absent.json"]


# for a module (`pytestmark = needs_shared`) or a test whose models come from the fixtures
needs_shared = pytest.mark.usefixtures("fixture_models")
