"""The Bench page: `helexa bench run`'s history, a chart per scenario and metric across
builds (one line per target and model, server-rendered SVG like the spend chart) with the
report's table beside it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from litestar import Request, Response, get

from helexa.bench import history as bh
from helexa.gateway.service import Gateway
from helexa.web.admin_common import render

W, H = 480, 200  # the viewBox
PAD_L, PAD_R, PAD_T, PAD_B = 8, 12, 14, 30
SERIES_COLOURS = 8  # .s0 … .s7 in admin.css, then round again


@dataclass(frozen=True, slots=True)
class Dot:
    x: float
    y: float
    label: str  # the tooltip


@dataclass(frozen=True, slots=True)
class Line:
    name: str  # "target · model"
    colour: int
    points: str  # polyline points
    dots: list[Dot]


@dataclass(frozen=True, slots=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    """One metric of one scenario: a line per (target, model) over the builds."""

    metric: str
    label: str
    higher_is_better: bool
    lines: list[Line]
    ticks: list[Tick]
    max_value: float


@dataclass(frozen=True, slots=True)
class Row:
    """The report's row for one (target, model): the latest build's medians and changes."""

    target: str
    model: str
    build: str
    previous: str | None
    samples: int
    values: dict[str, tuple[str, str]]  # metric → ("412.0", "+3.1%" or "")


@dataclass(frozen=True, slots=True)
class ScenarioView:
    name: str
    charts: list[Chart]
    rows: list[Row]
    metrics: list[str]


def _charts(series: list[bh.Series]) -> list[Chart]:
    builds: list[bh.Build] = []  # every build any series sampled, by when first sampled
    for version in sorted((v for s in series for v in s.versions), key=lambda v: v.first):
        if version.build not in builds:
            builds.append(version.build)
    slot = (W - PAD_L - PAD_R) / max(1, len(builds))
    x_of = {b: round(PAD_L + slot * (i + 0.5), 1) for i, b in enumerate(builds)}
    every = -(-len(builds) // 5)  # at most 5 labels along the bottom
    ticks = [Tick(x_of[b], b.label[:9]) for i, b in enumerate(builds) if i % every == 0]
    charts = []
    metrics = [m for m in bh.METRICS if any(m in s.metrics() for s in series)]
    for metric in metrics:
        label, higher = bh.METRICS[metric]
        top = max((v.medians[metric] or 0.0 for s in series for v in s.versions), default=0.0)
        top = top * 1.1 or 1.0
        lines = []
        for i, s in enumerate(series):
            dots = []
            for v in s.versions:
                value = v.medians[metric]
                if value is None:
                    continue
                y = round(H - PAD_B - (H - PAD_B - PAD_T) * value / top, 1)
                dots.append(
                    Dot(
                        x_of[v.build],
                        y,
                        f"{s.target} · {s.model} at {v.build.label}: {label} "
                        f"{bh.format_value(metric, value)} ({v.samples} samples, "
                        f"last {v.last:%Y-%m-%d %H:%M} UTC)",
                    )
                )
            if dots:
                points = " ".join(f"{d.x},{d.y}" for d in dots)
                name = f"{s.target} · {s.model}"
                lines.append(Line(name, i % SERIES_COLOURS, points, dots))
        charts.append(Chart(metric, label, higher, lines, ticks, top / 1.1))
    return charts


def _rows(series: list[bh.Series], metrics: list[str]) -> list[Row]:
    rows = []
    for s in series:
        values = {}
        for metric in metrics:
            value = bh.format_value(metric, s.latest.medians[metric])
            values[metric] = (value, bh.format_change(s.change(metric)))
        previous = s.previous.build.label if s.previous else None
        rows.append(
            Row(s.target, s.model, s.latest.build.label, previous, s.latest.samples, values)
        )
    return rows


def scenario_views(series: list[bh.Series]) -> list[ScenarioView]:
    by_scenario: dict[str, list[bh.Series]] = {}
    for s in series:
        by_scenario.setdefault(s.scenario, []).append(s)
    views = []
    # full scenarios first, their quick versions (smoke tests) after
    for name in sorted(by_scenario, key=lambda n: (n.endswith("-quick"), bh.scenario_key(n))):
        group = sorted(by_scenario[name], key=lambda s: (s.target, s.model))
        charts = _charts(group)
        metrics = [c.metric for c in charts]
        views.append(ScenarioView(name, charts, _rows(group, metrics), metrics))
    return views


@get("/bench")
async def bench_page(request: Request, gateway: Gateway) -> Response:
    target = request.query_params.get("target") or None
    model = request.query_params.get("model") or None
    everything = await asyncio.to_thread(bh.history, gateway.sessions)
    shown = [
        s
        for s in everything
        if (target is None or s.target == target) and (model is None or s.model == model)
    ]
    return render(
        request,
        "bench",
        targets=sorted({s.target for s in everything}),
        models=sorted({s.model for s in everything}),
        params={"target": target or "", "model": model or ""},
        scenarios=scenario_views(shown),
        metric_labels={m: label for m, (label, _) in bh.METRICS.items()},
        chart_w=W,
        chart_h=H,
        pad_b=PAD_B,
        pad_t=PAD_T,
    )


BENCH_HANDLERS = [bench_page]
