"""Saved sessions: one JSON file per session under `$XDG_DATA_HOME/helexa/acp/sessions/`,
written (atomically: a temporary file renamed over it) after every round of a prompt, so
that an editor restart or a later round that stalls loses nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from helexa.acp.wire import Message, ToolCall

log = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


@dataclass(slots=True)
class Saved:
    id: str
    cwd: str
    model: str  # the picker's id
    mode: str
    history: list[Message] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        """The first user turn, shortened: how a session list names it."""
        first = next((m.content for m in self.history if m.role == "user" and m.content), "")
        line = " ".join(first.split())
        return line[:60] + ("…" if len(line) > 60 else "") or "(empty)"


class Store:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, session_id: str) -> Path:
        if not _SAFE_ID.match(session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.directory / f"{session_id}.json"

    def save(self, saved: Saved) -> None:
        saved.updated = time.time()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(saved.id)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(saved), ensure_ascii=False))
        os.replace(tmp, path)

    def load(self, session_id: str) -> Saved:
        """FileNotFoundError when there is no such session; ValueError when it is damaged."""
        return _saved(json.loads(self.path(session_id).read_text()))

    def list(self, cwd: str | None = None) -> list[Saved]:
        """Saved sessions, the most recent first (of one project's directory when given);
        a damaged file is skipped with a warning."""
        out = []
        for path in self.directory.glob("*.json") if self.directory.is_dir() else []:
            try:
                saved = _saved(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("skipping the damaged session file %s: %s", path, e)
                continue
            if cwd is None or saved.cwd == cwd:
                out.append(saved)
        return sorted(out, key=lambda s: s.updated, reverse=True)


def _saved(data: dict[str, Any]) -> Saved:
    history = [
        Message(
            m["role"],
            m.get("content", ""),
            [ToolCall(**c) for c in m.get("tool_calls", [])],
            m.get("tool_call_id"),
            [tuple(i) for i in m.get("images", [])],  # type: ignore[misc]
        )
        for m in data["history"]
    ]
    return Saved(
        data["id"], data["cwd"], data["model"], data["mode"], history,
        data.get("created", 0.0), data.get("updated", 0.0),
    )  # fmt: skip
