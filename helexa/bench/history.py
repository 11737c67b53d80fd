"""Bench history in the database: what `helexa bench run` records, what it may skip, and
what `helexa bench report` and the console's Bench page read back.

A *cell* is (target, build, model, scenario), where a build is a git sha and whether the
tree was dirty (a dirty build is not the commit it sits on). A *version* of a cell's row is
its build: the report and the charts take each build's median over its samples and order
builds by when they were first sampled. No torch here: the gateway's console imports it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from helexa.db.models import BenchRun, BenchSample

# column → (label, higher is better); the order is the report's
METRICS: dict[str, tuple[str, bool]] = {
    "ttft_ms": ("TTFT ms", False),
    "decode_tok_s": ("decode tok/s", True),
    "tok_s": ("tok/s", True),
    "latency_ms": ("latency ms", False),
}


@dataclass(frozen=True, slots=True)
class Build:
    sha: str
    dirty: bool

    @property
    def label(self) -> str:
        short = self.sha[:12] if _is_hex(self.sha) else self.sha
        return f"{short}+dirty" if self.dirty else short


def _is_hex(text: str) -> bool:
    return len(text) >= 12 and all(c in "0123456789abcdef" for c in text.lower())


# -- writing -------------------------------------------------------------------------------
def start_run(
    sessions: sessionmaker[Session],
    *,
    target: str,
    target_url: str,
    build: Build,
    build_info: dict[str, Any] | None,
    host: str,
    quick: bool,
) -> int:
    """A new `bench_runs` row; its id."""
    with sessions() as s, s.begin():
        run = BenchRun(
            target=target,
            target_url=target_url,
            sha=build.sha,
            dirty=build.dirty,
            build=build_info,
            host=host,
            quick=quick,
        )
        s.add(run)
        s.flush()
        return run.id


def finish_run(sessions: sessionmaker[Session], run_id: int) -> None:
    with sessions() as s, s.begin():
        run = s.get(BenchRun, run_id)
        if run is not None:
            run.finished_at = datetime.now(UTC)


def record_sample(sessions: sessionmaker[Session], run_id: int, **values: Any) -> None:
    """One measurement, committed at once: an interrupted run keeps what it measured."""
    with sessions() as s, s.begin():
        s.add(BenchSample(run_id=run_id, **values))


def samples_taken(
    sessions: sessionmaker[Session], target: str, build: Build, model: str, scenario: str
) -> int:
    """How many samples the cell already holds."""
    with sessions() as s:
        return s.execute(
            select(func.count())
            .select_from(BenchSample)
            .where(
                BenchSample.target == target,
                BenchSample.sha == build.sha,
                BenchSample.dirty == build.dirty,
                BenchSample.model == model,
                BenchSample.scenario == scenario,
            )
        ).scalar_one()


# -- reading -------------------------------------------------------------------------------
@dataclass(slots=True)
class Version:
    """A build's samples of one (target, model, scenario), reduced to medians."""

    build: Build
    first: datetime
    last: datetime
    samples: int
    medians: dict[str, float | None]


@dataclass(slots=True)
class Series:
    """One (target, model, scenario): its builds in the order they were first sampled."""

    target: str
    model: str
    scenario: str
    versions: list[Version] = field(default_factory=list)

    @property
    def latest(self) -> Version:
        return self.versions[-1]

    @property
    def previous(self) -> Version | None:
        return self.versions[-2] if len(self.versions) > 1 else None

    def change(self, metric: str) -> float | None:
        """The latest build's median against the previous build's, as a fraction."""
        prev = self.previous
        now, before = self.latest.medians.get(metric), prev and prev.medians.get(metric)
        if now is None or not before:
            return None
        return now / before - 1.0

    def metrics(self) -> list[str]:
        """The metrics this scenario measures (any build has a value)."""
        return [m for m in METRICS if any(v.medians.get(m) is not None for v in self.versions)]


def history(
    sessions: sessionmaker[Session],
    *,
    target: str | None = None,
    model: str | None = None,
    scenario: str | None = None,
) -> list[Series]:
    """Every (target, model, scenario) with its builds' medians, sorted by those names."""
    query = select(BenchSample).order_by(BenchSample.ts, BenchSample.id)
    if target:
        query = query.where(BenchSample.target == target)
    if model:
        query = query.where(BenchSample.model == model)
    if scenario:
        query = query.where(BenchSample.scenario == scenario)
    with sessions() as s:
        rows = s.execute(query).scalars().all()
    return _series(rows)


def _series(rows: Iterable[BenchSample]) -> list[Series]:
    grouped: dict[tuple[str, str, str], dict[Build, list[BenchSample]]] = {}
    for row in rows:  # in time order, so each dict keeps builds in first-sampled order
        by_build = grouped.setdefault((row.target, row.model, row.scenario), {})
        by_build.setdefault(Build(row.sha, row.dirty), []).append(row)
    out = []
    for (target, model, scenario), by_build in sorted(grouped.items(), key=_scenario_order):
        series = Series(target, model, scenario)
        for build, samples in by_build.items():
            medians = {m: _median(getattr(r, m) for r in samples) for m in METRICS}
            series.versions.append(
                Version(build, _utc(samples[0].ts), _utc(samples[-1].ts), len(samples), medians)
            )
        out.append(series)
    return out


def scenario_key(scenario: str) -> tuple[str, int, str]:
    """Scenarios in their natural order: chat-128 before chat-4096, c4 before c16."""
    family, _, rest = scenario.partition("-")
    digits = "".join(c for c in rest.removesuffix("-quick") if c.isdigit())
    return family, int(digits or 0), scenario


def _scenario_order(item: tuple[tuple[str, str, str], Any]) -> tuple[Any, ...]:
    target, model, scenario = item[0]
    return target, model, *scenario_key(scenario)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)  # SQLite hands back naive UTC


# -- the report ----------------------------------------------------------------------------
def format_value(metric: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if metric.endswith("_ms") and value >= 100 else f"{value:,.1f}"


def format_change(change: float | None) -> str:
    return "" if change is None else f"{change * 100:+.1f}%"


def report(series: list[Series]) -> str:
    """A Markdown table: per cell, the latest build's medians and the change from the build
    sampled before it."""
    if not series:
        return "No bench samples yet: run `helexa bench run --target URL` first."
    head = ["target", "model", "scenario", "build", "samples"]
    head += [label for label, _ in METRICS.values()]
    head.append("previous build")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 5 + "---:|" * len(METRICS) + "---|"]
    for s in series:
        latest = s.latest
        cells = [s.target, s.model, s.scenario, f"`{latest.build.label}`", str(latest.samples)]
        for metric in METRICS:
            value = format_value(metric, latest.medians[metric])
            change = format_change(s.change(metric))
            cells.append(f"{value} ({change})" if change else value)
        cells.append(f"`{s.previous.build.label}`" if s.previous else "–")
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")
