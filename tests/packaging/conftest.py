"""The RPM that packaging/build-rpm makes, built once per session, and its files unpacked
as they would lie under / (rpm2archive: no cpio needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

BUILD_RPM = REPO_ROOT / "packaging" / "build-rpm"


def need(*tools: str) -> None:
    """Skip without `tools`; under CI (the CI variable set) fail: setup-env --packaging
    installs them."""
    missing = [t for t in tools if shutil.which(t) is None]
    if not missing:
        return
    why = f"needs {', '.join(missing)} (bash scripts/setup-env --packaging)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the packaging tests: {why}", pytrace=False)
    pytest.skip(why)


def unpack(rpm: Path, root: Path) -> Path:
    """The RPM's payload extracted into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    with rpm.open("rb") as f:
        archive = subprocess.run(["rpm2archive", "-"], stdin=f, capture_output=True, check=True)
    subprocess.run(
        ["tar", "-xzf", "-", "--no-same-owner", "-C", str(root)], input=archive.stdout, check=True
    )
    return root


def rpm_query(rpm: Path, *args: str) -> str:
    return subprocess.run(
        ["rpm", "-qp", *args, str(rpm)], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="session")
def rpm_path(tmp_path_factory) -> Path:
    need("rpmbuild", "rpm2archive")
    out = tmp_path_factory.mktemp("rpms")
    done = subprocess.run(
        ["bash", str(BUILD_RPM), str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.parent == out and path.is_file(), done.stdout
    return path


@pytest.fixture(scope="session")
def rpm_root(rpm_path, tmp_path_factory) -> Path:
    """The RPM's files under a temporary root; tests must not change them."""
    return unpack(rpm_path, tmp_path_factory.mktemp("rpm-root"))
