"""A model's CPU plans: read from this machine's plan file and checked, measured where missing
or beaten, and kept only when the machine was quiet while they were measured.

A plan measured while a neighbour held the CPU is wrong for the quiet machine, and a node
once kept such plans and decoded at 91 tok/s instead of 227 on every later start. So each
measurement is bracketed by `cpu_meter` readings: measured quiet, a plan is written to the
plan file with its conditions (when, what the rest of the machine took, the thread count);
measured busy, it serves this run only (`provisional`) and `retune.Retuner` measures it again
once the machine is quiet. Cached plans are checked at start (`autotune.holds`): one that now
loses by more than the noise is measured again. A check on a busy machine proves nothing, so
its shapes are re-measured in the background too (`stale`), the cached plans serving meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Generator, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from helexa.engine.layers.autotune import (
    BUCKETS,
    CACHE_VERSION,
    EXACT_BUCKETS,
    ROUNDS,
    Measured,
    Plan,
    Timer,
    holds,
    machine_key,
    measure,
    measuring,
    plan_for_rows,
    shape_key,
    timed,
)
from helexa.engine.layers.cpu_meter import CpuMeter, ProcStatMeter, Window

log = logging.getLogger(__name__)
TUNED_FORMATS = ("int4", "int8", "blocks")


@dataclass(slots=True)
class Conditions:
    """What a shape's plans were measured under."""

    at: float  # unix seconds
    others_cpus: float  # CPUs the rest of the machine took meanwhile (cpu_meter.Window)
    num_threads: int


@dataclass(slots=True)
class TuneReport:
    """What the autotune did for one loaded model, for the log and `/models`.

    state: "fresh" (some plans measured now, on a quiet machine, and kept), "cached" (every
    plan from the plan file, checked at start), "provisional" (some measured on a busy
    machine: used for this run, measured again when it is quiet) or "off"."""

    state: str
    num_shapes: int = 0
    num_measured: int = 0  # shapes this process measured (at load or in the background)
    num_provisional: int = 0
    num_replaced: int = 0  # cached shapes that lost their check at start
    num_pending: int = 0  # shapes waiting for a quiet machine to be measured again
    measured_at: float | None = None  # the oldest measurement among the plans in use
    others_cpus: float | None = None  # the rest of the machine during our last measurement

    def __str__(self) -> str:
        """The load's log line: `plans provisional: 7 shapes, 7 measured, ...`."""
        cached = self.num_shapes - self.num_measured
        parts = [f"{self.num_shapes} shapes", f"{self.num_measured} measured"]
        parts += [f"{cached} cached"] if cached else []
        parts += [f"{self.num_replaced} of the cached replaced"] if self.num_replaced else []
        if self.others_cpus is not None:
            parts.append(f"the rest of the machine took {self.others_cpus:.2f} CPUs")
        if self.num_pending:
            parts.append(f"{self.num_pending} to measure again once the machine is quiet")
        return f"plans {self.state}: " + ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The `/models` entry's `autotune`: measured_at in whole unix seconds."""
        out = asdict(self)
        if self.measured_at is not None:
            out["measured_at"] = int(self.measured_at)
        return out


# Plans measured quiet by this process where there is no cache directory, per machine key.
_MEASURED: dict[str, dict[str, tuple[list[Plan], int | None, Conditions]]] = {}


class Autotuner:
    """Plans for every packed Linear of a model, from the plan file or measured now."""

    def __init__(
        self,
        cache_dir: str | os.PathLike | None,
        num_threads: int,
        *,
        meter: CpuMeter | None = None,
        timer: Timer = timed,
        rounds: int = ROUNDS,
    ) -> None:
        self.machine = machine_key(num_threads)
        self.num_threads = num_threads
        self.path = None if cache_dir is None else Path(cache_dir) / f"{self.machine}.json"
        self.meter = meter or ProcStatMeter()
        self.timer, self.rounds = timer, rounds
        self.plans: dict[str, list[Plan]] = {}
        self.exact_rows: dict[str, int] = {}  # GGUF-block shapes only
        self.conditions: dict[str, Conditions] = {}
        for key, (plans, rows, cond) in self._read().items():
            self._set(key, Measured(plans, rows), cond)
        self.linears: dict[str, list[torch.nn.Module]] = {}
        self.measured: list[str] = []  # shapes timed by this process, not read from cache
        self.replaced: list[str] = []  # cached shapes whose check at start they lost
        self.provisional: set[str] = set()  # measured busy: this run's only
        self.stale: set[str] = set()  # cached, checked on a busy machine: re-measured later
        self.last_others: float | None = None

    @property
    def pending(self) -> list[str]:
        """Shapes to measure again once the machine is quiet."""
        return sorted(self.provisional | self.stale)

    def window(self) -> Window:
        return Window(self.meter.num_cpus, self.num_threads)

    def tune(self, linears: Iterable[torch.nn.Module]) -> None:
        """Give each packed Linear its plans: cached ones checked, the rest (and those that
        lost) measured, with the candidates in turns; kept only when measured quiet."""
        for linear in linears:
            if linear.format in TUNED_FORMATS:
                self.linears.setdefault(shape_key(linear), []).append(linear)
        cached = [k for k in self.linears if self._is_cached(k)]
        check = self.window()
        lost = [k for k in cached if not self._metered(check, self._holds, k)]
        if cached:
            self.last_others = round(check.others_cpus, 3)
        if not check.is_quiet:  # a verdict timed on a busy machine proves nothing
            self.stale.update(cached)
            lost = []
        self.replaced = lost
        todo = [k for k in self.linears if k not in cached] + lost
        if todo:
            window = self.window()
            results = {k: self._metered(window, self._measure, k) for k in todo}
            self.adopt(results, window)
        for key in self.linears:
            self._apply(key)

    def remeasuring(self) -> Generator[None, None, dict[str, Measured]]:
        """Measure every pending shape again, a slice at a time (see autotune.measuring)."""
        results: dict[str, Measured] = {}
        for key in self.pending:
            results[key] = yield from measuring(self.linears[key][0], self.timer, self.rounds)
        return results

    def adopt(self, results: dict[str, Measured], window: Window) -> None:
        """Take newly measured plans into use; keep them in the plan file if `window` (their
        measurement's readings) was quiet, else serve them for this run only."""
        cond = Conditions(time.time(), round(window.others_cpus, 3), self.num_threads)
        for key, measured in results.items():
            self._set(key, measured, cond)
            self._apply(key)
        self.measured += [k for k in results if k not in self.measured]
        self.last_others = cond.others_cpus
        if window.is_quiet:
            self.provisional.difference_update(results)
            self.stale.difference_update(results)
            self._keep(list(results))
        else:
            self.provisional.update(results)

    def report(self) -> TuneReport:
        keys = set(self.linears)
        if not keys:
            return TuneReport("off")
        provisional = len(self.provisional & keys)
        measured = len(set(self.measured) & keys)
        state = "provisional" if provisional else "fresh" if measured else "cached"
        return TuneReport(
            state,
            num_shapes=len(keys),
            num_measured=measured,
            num_provisional=provisional,
            num_replaced=len(self.replaced),
            num_pending=len(self.pending),
            measured_at=min(self.conditions[k].at for k in keys),
            others_cpus=self.last_others,
        )

    # -- plans -----------------------------------------------------------------------
    def _is_cached(self, key: str) -> bool:
        blocks = self.linears[key][0].format == "blocks"
        return key in self.plans and (not blocks or key in self.exact_rows)

    def _metered(self, window: Window, fn, key: str):
        start = self.meter.read()
        try:
            return fn(key)
        finally:
            window.add(start, self.meter.read())

    def _holds(self, key: str) -> bool:
        return holds(self.linears[key][0], self.plans[key], self.timer, self.rounds)

    def _measure(self, key: str) -> Measured:
        t0 = time.perf_counter()
        measured = measure(self.linears[key][0], self.timer, self.rounds)
        log.debug("autotune %s: %s in %.2fs", key, measured, time.perf_counter() - t0)
        return measured

    def _set(self, key: str, measured: Measured, cond: Conditions) -> None:
        self.plans[key] = measured.plans
        if measured.exact_rows is not None:
            self.exact_rows[key] = measured.exact_rows
        self.conditions[key] = cond

    def _apply(self, key: str) -> None:
        """Every Linear of `key`'s shape runs its plans (one assignment each: the engine
        swaps between steps, see retune)."""
        by_rows = plan_for_rows(self.plans[key])
        for linear in self.linears[key]:
            linear.plans = by_rows
            if linear.format == "blocks":
                linear.exact_rows = self.exact_rows[key]

    # -- the plan file ---------------------------------------------------------------
    def _entry(self, key: str) -> tuple[list[Plan], int | None, Conditions]:
        return self.plans[key], self.exact_rows.get(key), self.conditions[key]

    def _read(self) -> dict[str, tuple[list[Plan], int | None, Conditions]]:
        if self.path is None:  # no cache directory: this process's quiet measurements
            return dict(_MEASURED.get(self.machine, {}))
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # absent or damaged: measured again, then written anew
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        exact = data.get("exact_rows") or {}
        conditions = data.get("conditions") or {}
        entries = {}
        for key, value in (data.get("plans") or {}).items():
            try:
                plans = [(bool(dense), int(chunk)) for dense, chunk in value]
                rows = exact.get(key)
                rows = None if rows is None else int(rows)
                cond = Conditions(**conditions[key])
            except (TypeError, ValueError, AttributeError, KeyError):
                continue  # a damaged entry, or one with no conditions: measured again
            if rows is not None and rows not in (0, *EXACT_BUCKETS):
                continue
            if len(plans) == len(BUCKETS) and all(c in (0, *BUCKETS) for _, c in plans):
                entries[key] = (plans, rows, cond)
        return entries

    def _keep(self, keys: list[str]) -> None:
        """Write `keys`' plans into the plan file, over what it holds now (another model's
        worker may have written shapes of its own since we read it)."""
        if self.path is None:
            table = _MEASURED.setdefault(self.machine, {})
            table.update({k: self._entry(k) for k in keys})
            return
        entries = self._read()
        entries.update({k: self._entry(k) for k in keys})
        body = {
            "version": CACHE_VERSION,
            "buckets": list(BUCKETS),
            "plans": {k: plans for k, (plans, _, _) in entries.items()},
            "exact_rows": {k: rows for k, (_, rows, _) in entries.items() if rows is not None},
            "conditions": {k: asdict(cond) for k, (_, _, cond) in entries.items()},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:  # a read-only state_dir costs a re-measure next time, no more
            log.warning("autotune: cannot keep plans in %s: %s", self.path, e)
