"""API keys and their budgets: create, list, revoke, re-budget, and look up by secret.

Only a sha256 of each secret is stored, with a short visible prefix to recognise it by; the
secret itself is returned once, by `create`. The gateway's auth resolves a bearer token with
`lookup`; `helexa keys …` drives the rest.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from helexa.db.models import Account, ApiKey, Budget, SpendRecord, utcnow

SECRET_PREFIX = "hx-"
PREFIX_CHARS = 10  # of the secret, kept in clear so people can tell keys apart
WINDOWS = ("balance", "rolling:SECONDS")


def hash_secret(secret: str) -> str:
    """The sha256 hex digest of the whole secret: what `api_keys.secret_hash` holds."""
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_window(text: str) -> tuple[str, int | None]:
    """`"balance"` → `("balance", None)`; `"rolling:3600"` → `("rolling", 3600)`."""
    if text == "balance":
        return "balance", None
    m = re.fullmatch(r"rolling:(\d+)", text)
    if m is None or int(m[1]) <= 0:
        raise ValueError(
            f"budget window {text!r} is not one of {' or '.join(WINDOWS)} "
            "(SECONDS a positive integer, e.g. rolling:3600)"
        )
    return "rolling", int(m[1])


@dataclass(frozen=True, slots=True)
class BudgetInfo:
    cap_tokens: int | None
    cap_cost_usd: float | None
    window: str  # "balance" | "rolling"
    window_seconds: int | None  # for "rolling"

    def describe(self) -> str:
        caps = []
        if self.cap_tokens is not None:
            caps.append(f"{self.cap_tokens} tokens")
        if self.cap_cost_usd is not None:
            caps.append(f"${self.cap_cost_usd:g}")
        over = "balance" if self.window == "balance" else f"rolling:{self.window_seconds}"
        return f"{' and '.join(caps)} ({over})"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key as the rest of the gateway sees it: never its secret, never its hash."""

    id: str
    account_id: str
    name: str | None
    prefix: str
    allowed_models: tuple[str, ...] | None  # None: every model
    budget: BudgetInfo | None
    created_at: datetime
    revoked_at: datetime | None

    def allows(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class KeyStore:
    """Keys and budgets in the gateway's database; each call is its own transaction."""

    # `list` below shadows the builtin inside this class, hence `builtins.list` after it

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def create(
        self,
        account: str,
        *,
        name: str | None = None,
        models: list[str] | None = None,
        cap_tokens: int | None = None,
        cap_cost_usd: float | None = None,
        window: str = "balance",
    ) -> tuple[KeyInfo, str]:
        """A new key for `account` (created if missing); returns it and its secret, once."""
        account = account.strip() if account else ""
        if not account:
            raise ValueError("a key needs an account: --account NAME (non-empty)")
        allowed = _check_models(models)
        budget = check_budget(cap_tokens, cap_cost_usd, window)
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        with self.sessions.begin() as s:
            if s.get(Account, account) is None:
                s.add(Account(id=account))
            key = ApiKey(
                id="key_" + secrets.token_hex(6),
                account_id=account,
                name=name or None,
                prefix=secret[:PREFIX_CHARS],
                secret_hash=hash_secret(secret),
                allowed_models=allowed,
                created_at=utcnow(),
            )
            s.add(key)
            if budget is not None:
                s.add(_budget_row(key.id, budget))
            s.flush()
            return _info(key, budget), secret

    def list(
        self, *, account: str | None = None, include_revoked: bool = True
    ) -> builtins.list[KeyInfo]:
        """Keys, oldest first, optionally of one account and/or only the active ones."""
        q = select(ApiKey).options(selectinload(ApiKey.budget))
        if account is not None:
            q = q.where(ApiKey.account_id == account)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        with self.sessions() as s:
            return [
                _info(k, _budget_info(k.budget))
                for k in s.scalars(q.order_by(ApiKey.created_at, ApiKey.id))
            ]

    def get(self, key_id: str) -> KeyInfo | None:
        with self.sessions() as s:
            key = s.get(ApiKey, key_id)
            return None if key is None else _info(key, _budget_info(key.budget))

    def revoke(self, key_id: str) -> bool:
        """Revoke a key; False if it is unknown or already revoked."""
        with self.sessions.begin() as s:
            key = s.get(ApiKey, key_id)
            if key is None or key.revoked_at is not None:
                return False
            key.revoked_at = utcnow()
            return True

    def set_budget(
        self,
        key_id: str,
        *,
        cap_tokens: int | None = None,
        cap_cost_usd: float | None = None,
        window: str = "balance",
    ) -> KeyInfo:
        """Replace a key's budget; with both caps None the key has none. KeyError if unknown."""
        budget = check_budget(cap_tokens, cap_cost_usd, window)
        with self.sessions.begin() as s:
            key = s.get(ApiKey, key_id)
            if key is None:
                raise KeyError(key_id)
            row = s.get(Budget, key_id)
            if row is not None:
                s.delete(row)
                s.flush()
            if budget is not None:
                s.add(_budget_row(key_id, budget))
            s.flush()
            return _info(key, budget)

    def set_models(self, key_id: str, models: builtins.list[str] | None) -> KeyInfo:
        """Replace the models a key may use (None: every model). KeyError if unknown."""
        allowed = _check_models(models)
        with self.sessions.begin() as s:
            key = s.get(ApiKey, key_id)
            if key is None:
                raise KeyError(key_id)
            key.allowed_models = allowed
            s.flush()
            return _info(key, _budget_info(key.budget))

    def lookup(self, secret: str) -> KeyInfo | None:
        """The active key whose secret this is; None for an unknown or revoked one."""
        digest = hash_secret(secret)
        with self.sessions() as s:
            q = select(ApiKey).where(ApiKey.secret_hash == digest)
            key = s.scalars(q.options(selectinload(ApiKey.budget))).one_or_none()
            if key is None or not hmac.compare_digest(key.secret_hash, digest):
                return None
            return _info(key, _budget_info(key.budget)) if key.revoked_at is None else None

    def spend_totals(
        self,
        *,
        key_id: str | None = None,
        account: str | None = None,
        since: datetime | None = None,
    ) -> builtins.list[dict]:
        """Ledger totals per (key_id, account_id, model): requests, prompt_tokens,
        cached_tokens, completion_tokens, cost_usd. Anonymous requests have key_id None."""
        r = SpendRecord
        q = select(
            r.key_id,
            r.account_id,
            r.model,
            func.count().label("requests"),
            func.coalesce(func.sum(r.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(r.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(r.completion_tokens), 0).label("completion_tokens"),
            func.coalesce(func.sum(r.cost_usd), 0.0).label("cost_usd"),
        ).group_by(r.key_id, r.account_id, r.model)
        if key_id is not None:
            q = q.where(r.key_id == key_id)
        if account is not None:
            q = q.where(r.account_id == account)
        if since is not None:
            # stored as UTC; SQLite keeps no offset, so compare in UTC too
            since = since.replace(tzinfo=UTC) if since.tzinfo is None else since.astimezone(UTC)
            q = q.where(r.ts >= since)
        with self.sessions() as s:
            rows = [dict(row._mapping) for row in s.execute(q)]
        rows.sort(key=lambda d: (d["key_id"] or "", d["account_id"] or "", d["model"]))
        for d in rows:
            d["cost_usd"] = float(d["cost_usd"])
        return rows


def _check_models(models: list[str] | None) -> list[str] | None:
    if models is None:
        return None
    allowed = list(dict.fromkeys(m.strip() for m in models if m.strip()))
    if not allowed:
        raise ValueError("--models names no model; leave it out to allow every model")
    return allowed


def check_budget(
    cap_tokens: int | None,
    cap_cost_usd: float | None,
    window: str,
    *,
    names: tuple[str, str] = ("--cap-tokens", "--cap-cost"),
) -> BudgetInfo | None:
    """The one rule for a key's budget: positive caps, a known window; None when it sets no
    cap. `names` are the caps as the caller's user knows them (CLI flags, form labels)."""
    kind, seconds = parse_window(window)
    tokens_name, cost_name = names
    if cap_tokens is not None and (isinstance(cap_tokens, bool) or cap_tokens <= 0):
        raise ValueError(f"{tokens_name} must be a positive integer, got {cap_tokens!r}")
    if cap_cost_usd is not None and not (math.isfinite(cap_cost_usd) and cap_cost_usd > 0):
        raise ValueError(f"{cost_name} must be a positive amount of USD, got {cap_cost_usd!r}")
    if cap_tokens is None and cap_cost_usd is None:
        return None
    return BudgetInfo(cap_tokens, cap_cost_usd, kind, seconds)


def _budget_row(key_id: str, b: BudgetInfo) -> Budget:
    return Budget(
        key_id=key_id,
        cap_tokens=b.cap_tokens,
        cap_cost_usd=b.cap_cost_usd,
        window=b.window,
        window_seconds=b.window_seconds,
        updated_at=utcnow(),
    )


def _budget_info(b: Budget | None) -> BudgetInfo | None:
    if b is None:
        return None
    return BudgetInfo(b.cap_tokens, b.cap_cost_usd, b.window, b.window_seconds)


def _info(key: ApiKey, budget: BudgetInfo | None) -> KeyInfo:
    models = key.allowed_models
    return KeyInfo(
        id=key.id,
        account_id=key.account_id,
        name=key.name,
        prefix=key.prefix,
        allowed_models=None if models is None else tuple(models),
        budget=budget,
        created_at=as_utc(key.created_at),
        revoked_at=None if key.revoked_at is None else as_utc(key.revoked_at),
    )


def as_utc(ts: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


def format_keys(keys: list[KeyInfo]) -> str:
    """The `helexa keys list` table: no secrets, no hashes."""
    header = ("ID", "ACCOUNT", "NAME", "PREFIX", "MODELS", "BUDGET", "CREATED", "REVOKED")
    rows = [header] + [
        (
            k.id,
            k.account_id,
            k.name or "-",
            k.prefix + "...",
            ",".join(k.allowed_models) if k.allowed_models is not None else "*",
            k.budget.describe() if k.budget else "-",
            f"{k.created_at:%Y-%m-%d %H:%M}",
            f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "-",
        )
        for k in keys
    ]
    return format_table(rows)


def describe_key(k: KeyInfo) -> str:
    """A few lines about one key, for `keys create` and `keys set-budget`."""
    models = ", ".join(k.allowed_models) if k.allowed_models is not None else "every model"
    return (
        f"key      {k.id}\n"
        f"account  {k.account_id}\n"
        + (f"name     {k.name}\n" if k.name else "")
        + f"models   {models}\n"
        f"budget   {k.budget.describe() if k.budget else 'none'}"
    )


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
