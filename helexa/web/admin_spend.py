"""The Spend page: the ledger filtered and paged, totals per key and per model, and tokens
and cost over time as a server-rendered SVG chart."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from urllib.parse import urlencode

from litestar import Request, Response, get

from helexa.gateway import spend_query as sq
from helexa.gateway.service import Gateway
from helexa.web.admin_common import PREFIX, render

CHART_W, CHART_H, CHART_PAD = 720, 160, 4


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    w: float
    h: float
    label: str  # the tooltip


@dataclass(frozen=True, slots=True)
class Chart:
    """An SVG's worth of geometry (viewBox 0 0 CHART_W CHART_H): token bars and a cost line."""

    bars: list[Bar]
    cost_points: str  # polyline points
    max_tokens: int
    max_cost: float
    first: datetime
    last: datetime
    step_s: int
    empty: bool


def chart(series: sq.Series) -> Chart:
    buckets = series.buckets
    max_tokens = max((b.tokens for b in buckets), default=0)
    max_cost = max((b.cost_usd for b in buckets), default=0.0)
    inner_h = CHART_H - 2 * CHART_PAD
    slot = CHART_W / max(1, len(buckets))
    bars, points = [], []
    for i, b in enumerate(buckets):
        h = inner_h * b.tokens / max_tokens if max_tokens else 0.0
        bars.append(
            Bar(
                x=round(i * slot + slot * 0.1, 2),
                y=round(CHART_H - CHART_PAD - h, 2),
                w=round(slot * 0.8, 2),
                h=round(h, 2),
                label=f"{b.start:%Y-%m-%d %H:%M} UTC: {b.tokens:,} tokens, "
                f"${b.cost_usd:.4f}, {b.requests:,} requests",
            )
        )
        y = CHART_H - CHART_PAD - (inner_h * b.cost_usd / max_cost if max_cost else 0.0)
        points.append(f"{i * slot + slot / 2:.1f},{y:.1f}")
    return Chart(
        bars,
        " ".join(points),
        max_tokens,
        max_cost,
        buckets[0].start if buckets else series.start,
        buckets[-1].start if buckets else series.start,
        series.step_s,
        empty=max_tokens == 0 and max_cost == 0,
    )


def _step_name(seconds: int) -> str:
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0:
            n = seconds // size
            return f"{n} {unit}{'s' if n > 1 else ''}" if n > 1 else unit
    return f"{seconds} s"


def _cursor(request: Request, name: str) -> int | None:
    value = request.query_params.get(name) or ""
    return int(value) if value.isdigit() else None


def _links(f: sq.SpendFilter, ledger: sq.LedgerPage, paged: bool) -> dict[str, str | None]:
    """The ledger's paging links, each keeping the filter."""
    kept = f.params()

    def link(**cursor: int) -> str:
        return f"{PREFIX}/spend?" + urlencode(kept | {k: str(v) for k, v in cursor.items()})

    return {
        "newest_link": link() if paged else None,
        "newer_link": link(after=ledger.newer) if ledger.newer else None,
        "older_link": link(before=ledger.older) if ledger.older else None,
    }


@get("/spend")
async def spend_page(request: Request, gateway: Gateway) -> Response:
    params = {
        k: request.query_params.get(k) or "" for k in ("key", "account", "model", "since", "until")
    }
    now = datetime.now(UTC)
    try:
        f, error = sq.SpendFilter.parse(params, now), None
    except ValueError as e:
        f, error = sq.SpendFilter(), str(e)
    before, after = _cursor(request, "before"), _cursor(request, "after")
    view = await asyncio.to_thread(
        sq.spend_view, gateway.sessions, f, before=before, after=after, now=now
    )
    return render(
        request,
        "spend",
        status=422 if error else 200,
        error=error,
        params=params,
        anonymous=sq.ANONYMOUS,
        models=sorted(set(gateway.router.catalogue) | {t.name for t in view.by_model if t.name}),
        chart=chart(view.series),
        step_name=_step_name(view.series.step_s),
        chart_w=CHART_W,
        chart_h=CHART_H,
        **_links(f, view.ledger, paged=bool(before or after)),
        **{field.name: getattr(view, field.name) for field in fields(view)},
    )


SPEND_HANDLERS = [spend_page]
