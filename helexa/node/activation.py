"""Progress of the default models' background load, as `/health` `activation` reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Activation:
    """pre_warming while default models are still loading, then ready (failures included)."""

    pending: list[str] = field(default_factory=list)
    in_progress: str | None = None
    completed: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)

    @property
    def state(self) -> str:
        return "pre_warming" if self.pending or self.in_progress else "ready"

    def start(self, model_ids: list[str]) -> None:
        self.pending = list(model_ids)

    def begin(self, model_id: str) -> None:
        self.pending.remove(model_id)
        self.in_progress = model_id

    def succeed(self, model_id: str) -> None:
        self.in_progress = None
        self.completed.append(model_id)

    def fail(self, model_id: str, error: str) -> None:
        self.in_progress = None
        self.failed.append({"model_id": model_id, "error": error})

    def summary(self) -> str:
        """One line: how many default models loaded, and which failed."""
        num_total = len(self.completed) + len(self.failed) + len(self.pending)
        num_total += self.in_progress is not None
        line = f"{len(self.completed)} of {num_total} default models loaded"
        if self.failed:
            line += "; failed: " + ", ".join(f["model_id"] for f in self.failed)
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "pending": list(self.pending),
            "in_progress": self.in_progress,
            "completed": list(self.completed),
            "failed": [dict(f) for f in self.failed],
        }
