"""`helexa spend`: what the ledger says each key spent, as a table with a grand total."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from helexa.gateway.keys import format_table

# the counted columns, in the table's order (cached: prompt tokens read from the cache)
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`"2026-11-01"` (UTC midnight), an ISO date-time, or a span back from now: `"24h"`, `"7d"`."""
    now = now or datetime.now(UTC)
    m = re.fullmatch(r"(\d+)([smhdw])", text.strip())
    if m:
        return now - timedelta(seconds=int(m[1]) * UNITS[m[2]])
    try:
        ts = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither a date (2026-11-01), an ISO date-time, "
            "nor a span back from now (90m, 24h, 7d, 2w)"
        ) from None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


def per_key(rows: list[dict]) -> list[dict]:
    """Roll `KeyStore.spend_totals` rows (per key, account, model) up to one row per key."""
    totals: dict[tuple[str | None, str | None], dict] = {}
    for r in rows:
        t = totals.setdefault(
            (r["key_id"], r["account_id"]),
            {"key_id": r["key_id"], "account_id": r["account_id"], "models": []}
            | dict.fromkeys(COUNTS, 0)
            | {"cost_usd": 0.0},
        )
        t["models"].append(r["model"])
        for field in (*COUNTS, "cost_usd"):
            t[field] += r.get(field, 0)
    return list(totals.values())


def format_spend(rows: list[dict]) -> str:
    """One line per key (anonymous requests as `(anonymous)`), then the grand total."""
    keys = per_key(rows)
    header = ("KEY", "ACCOUNT", "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "COST_USD", "MODELS")
    total = {f: sum(k[f] for k in keys) for f in (*COUNTS, "cost_usd")}
    lines = [header]
    for k in keys:
        lines.append(
            (
                k["key_id"] or "(anonymous)",
                k["account_id"] or "-",
                *_numbers(k),
                ",".join(k["models"]),
            )
        )
    lines.append(("TOTAL", "", *_numbers(total), ""))
    return format_table(lines)


def _numbers(t: dict) -> tuple[str, ...]:
    return (*(str(t[f]) for f in COUNTS), f"{t['cost_usd']:.6f}")
