"""Build information without torch (the gateway's `/version`; the node adds its runtime
versions in helexa/node/version.py): package version, git commit, build time, Python."""

from __future__ import annotations

import functools
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import helexa

PACKAGE_DIR = Path(helexa.__file__).resolve().parent
# Written into the wheel by packaging/build-rpm, where there is no git checkout to ask.
BUILD_JSON = PACKAGE_DIR / "_build_info.json"
GIT_TIMEOUT_S = 5


@functools.cache
def build_info() -> dict[str, Any]:
    """{version, git_sha, git_dirty, build_time, python}; computed once per process, so
    callers must not mutate it."""
    git = _read_build_json(BUILD_JSON) or _git_info(PACKAGE_DIR.parent)
    return {
        "version": helexa.__version__,
        "git_sha": git["git_sha"],
        "git_dirty": git["git_dirty"],
        "build_time": git["build_time"],
        "python": platform.python_version(),
    }


def _read_build_json(path: Path) -> dict[str, Any] | None:
    """{git_sha, git_dirty, build_time} from a packaging-written JSON file, or None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        # Absent (a git checkout) or damaged: fall back to asking git.
        return None
    if not isinstance(data, dict):
        return None
    sha, dirty, built = data.get("git_sha"), data.get("git_dirty"), data.get("build_time")
    return {
        "git_sha": sha if isinstance(sha, str) else None,
        "git_dirty": dirty if isinstance(dirty, bool) else None,
        "build_time": built if isinstance(built, str) else None,
    }


def _git_info(root: Path) -> dict[str, Any]:
    """{git_sha, git_dirty, build_time=None} from the checkout at `root`; Nones where unknown."""
    info: dict[str, Any] = {"git_sha": None, "git_dirty": None, "build_time": None}
    # Only the checkout the package lives in counts: an installed copy under some other
    # repository (a venv inside a project) must not report that project's commit.
    if not (root / ".git").exists():
        return info
    sha = _git(root, "rev-parse", "HEAD")
    if sha is None:
        return info
    info["git_sha"] = sha.strip() or None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    info["git_dirty"] = None if status is None else bool(status.strip())
    return info


def _git(root: Path, *args: str) -> str | None:
    """stdout of `git <args>` run in `root`, or None on any failure (no git, not a repo, …)."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None
