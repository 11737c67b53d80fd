"""Who may use /admin: the password check, server-side sessions with their CSRF tokens (in
the database, shared by every gateway on it), and a small brake on password guessing (per
process). No HTTP here; `helexa.web.admin` wires it to cookies.

Password hashes are helexa/passwords.py's `scrypt$N$r$p$salt$hash`. `HELEXA_ADMIN_PASSWORD`
supplies a plain password instead; either way the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from helexa.config import AdminConfig
from helexa.db.models import AdminSessionRow
from helexa.passwords import parse_hash, verify_password

MAX_FAILURES = 5  # per client within FAILURE_WINDOW_S, then it waits
FAILURE_WINDOW_S = 60.0
MAX_SESSIONS = 1000


class PasswordCheck:
    """The configured admin password: a hash from the file, or the env's plain password."""

    def __init__(self, password_hash: str | None, password: str | None) -> None:
        if password_hash:
            parse_hash(password_hash)  # refuse a broken hash at start-up, not at login
        self.password_hash = password_hash or None
        self.password = password or None

    @property
    def enabled(self) -> bool:
        """No password configured: the console is off, never open."""
        return self.password_hash is not None or self.password is not None

    def check(self, attempt: str) -> bool:
        if self.password is not None:
            want = hashlib.sha256(self.password.encode()).digest()
            if hmac.compare_digest(hashlib.sha256(attempt.encode()).digest(), want):
                return True
        if self.password_hash is not None:
            return verify_password(attempt, self.password_hash)
        return False


@dataclass(frozen=True, slots=True)
class AdminSession:
    token: str  # the cookie's value; the database holds only its sha256
    csrf: str  # sent back by every state-changing request
    expires_at: float


def token_hash(token: str) -> str:
    """What `admin_sessions.token_hash` holds for a cookie's token: a database leak logs no
    one in."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SessionStore:
    """Logged-in admin sessions in the gateway's database (`admin_sessions`): a restart keeps
    them and every gateway on the database serves them. Each call is one short transaction
    on `db`; the web layer makes it off the event loop. Expired rows go when someone logs in
    or shows an expired cookie."""

    ttl_s: float

    def create(self, db: sessionmaker[Session], now: float | None = None) -> AdminSession:
        now = time.time() if now is None else now
        expires = _utc(now + self.ttl_s)  # to the microsecond, as the database keeps it
        session = AdminSession(
            secrets.token_urlsafe(32), secrets.token_urlsafe(32), expires.timestamp()
        )
        with db.begin() as s:
            s.execute(delete(AdminSessionRow).where(AdminSessionRow.expires_at <= _utc(now)))
            live = s.scalar(select(func.count()).select_from(AdminSessionRow)) or 0
            if live >= MAX_SESSIONS:  # keep the newest; the oldest log in again
                oldest = s.scalars(
                    select(AdminSessionRow.token_hash)
                    .order_by(AdminSessionRow.created_at, AdminSessionRow.token_hash)
                    .limit(live - MAX_SESSIONS + 1)
                ).all()
                s.execute(delete(AdminSessionRow).where(AdminSessionRow.token_hash.in_(oldest)))
            s.add(
                AdminSessionRow(
                    token_hash=token_hash(session.token),
                    csrf=session.csrf,
                    created_at=_utc(now),
                    expires_at=expires,
                )
            )
        return session

    def get(
        self, db: sessionmaker[Session], token: str | None, now: float | None = None
    ) -> AdminSession | None:
        """The live session behind a cookie value; None when unknown or expired."""
        if not token:
            return None
        now = time.time() if now is None else now
        with db() as s:
            row = s.get(AdminSessionRow, token_hash(token))
            if row is None:
                return None
            expires_at = _timestamp(row.expires_at)
            if expires_at <= now:
                s.delete(row)
                s.commit()
                return None
            return AdminSession(token, row.csrf, expires_at)

    def drop(self, db: sessionmaker[Session], token: str | None) -> None:
        if token:
            with db.begin() as s:
                s.execute(
                    delete(AdminSessionRow).where(AdminSessionRow.token_hash == token_hash(token))
                )


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _timestamp(dt: datetime) -> float:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def csrf_ok(session: AdminSession, sent: str | None) -> bool:
    return bool(sent) and hmac.compare_digest(session.csrf.encode(), (sent or "").encode())


@dataclass(slots=True)
class LoginThrottle:
    """At most MAX_FAILURES wrong passwords per client per minute."""

    max_failures: int = MAX_FAILURES
    window_s: float = FAILURE_WINDOW_S
    _failures: dict[str, list[float]] = field(default_factory=dict)

    def wait_s(self, client: str, now: float | None = None) -> float:
        """Seconds `client` must wait before trying again (0: it may try now)."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self._failures.get(client, []) if t > now - self.window_s]
        self._failures[client] = recent
        if not recent:
            del self._failures[client]
        if len(recent) < self.max_failures:
            return 0.0
        return recent[0] + self.window_s - now

    def failed(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if len(self._failures) > 10_000:  # a flood of addresses must not grow this forever
            self._failures.clear()
        self._failures.setdefault(client, []).append(now)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


@dataclass(slots=True)
class Console:
    """The admin console's own state: its password, its logins (rows in the gateway's
    database, which the web layer passes in), who guessed wrong."""

    password: PasswordCheck
    logins: SessionStore
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    @classmethod
    def from_config(cls, cfg: AdminConfig) -> Console:
        return cls(PasswordCheck(cfg.password_hash, cfg.password), SessionStore(cfg.session_ttl_s))
