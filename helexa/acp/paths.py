"""Where `helexa acp` reads and writes: a tool's path as a model writes it (`~`, `$HOME`,
relative to the session's directory), the per-project plan directory plan mode may write
into, and the saved sessions."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path


def home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("HOME") or Path.home())


def expand(path: str, cwd: Path, env: Mapping[str, str] | None = None) -> Path:
    """A tool's path: `~`, `~/…`, `$HOME`, `$HOME/…` and `${HOME}/…` expanded, a relative
    one taken from the session's directory; normalised (`..` resolved lexically)."""
    text = path.strip()
    for prefix in ("${HOME}", "$HOME", "~"):
        if text == prefix or text.startswith(prefix + "/"):
            text = str(home(env)) + text[len(prefix) :]
            break
    full = Path(text)
    if not full.is_absolute():
        full = cwd / full
    return Path(os.path.normpath(full))


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_DATA_HOME/helexa/acp` (`~/.local/share/helexa/acp`)."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or str(home(env) / ".local" / "share")
    return Path(base) / "helexa" / "acp"


def plan_dir(cwd: Path, env: Mapping[str, str] | None = None) -> Path:
    """Plan mode's only writable place for a project: `<data>/plans/<name>-<8 hex>`, the hex
    a stable hash of the project's full path (two checkouts named alike stay apart)."""
    digest = hashlib.sha256(str(cwd).encode()).hexdigest()[:8]
    return data_dir(env) / "plans" / f"{cwd.name or 'root'}-{digest}"


def sessions_dir(env: Mapping[str, str] | None = None) -> Path:
    return data_dir(env) / "sessions"


def inside(path: Path, directory: Path) -> bool:
    """Whether `path` (normalised) is `directory` or below it."""
    return path == directory or directory in path.parents
