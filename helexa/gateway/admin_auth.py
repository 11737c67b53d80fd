"""Who may use /admin: the password check, server-side sessions with their CSRF tokens, and
a small brake on password guessing. No HTTP here; `helexa.web.admin` wires it to cookies.

Password hashes are helexa/passwords.py's `scrypt$N$r$p$salt$hash`. `HELEXA_ADMIN_PASSWORD`
supplies a plain password instead; either way the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

from helexa.config import AdminConfig
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


@dataclass(slots=True)
class AdminSession:
    token: str  # the cookie's value
    csrf: str  # sent back by every state-changing request
    expires_at: float


@dataclass(slots=True)
class SessionStore:
    """Logged-in admin sessions, in memory: a gateway restart logs everyone out."""

    ttl_s: float
    _sessions: dict[str, AdminSession] = field(default_factory=dict)

    def create(self, now: float | None = None) -> AdminSession:
        now = time.time() if now is None else now
        self._drop_expired(now)
        if len(self._sessions) >= MAX_SESSIONS:  # keep the newest; the oldest log in again
            oldest = min(self._sessions.values(), key=lambda s: s.expires_at)
            del self._sessions[oldest.token]
        session = AdminSession(
            secrets.token_urlsafe(32), secrets.token_urlsafe(32), now + self.ttl_s
        )
        self._sessions[session.token] = session
        return session

    def get(self, token: str | None, now: float | None = None) -> AdminSession | None:
        """The live session behind a cookie value; None when unknown or expired."""
        if not token:
            return None
        session = self._sessions.get(token)
        now = time.time() if now is None else now
        if session is None or session.expires_at <= now:
            self._sessions.pop(token, None)
            return None
        return session

    def drop(self, token: str | None) -> None:
        if token:
            self._sessions.pop(token, None)

    def _drop_expired(self, now: float) -> None:
        for token in [t for t, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[token]


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
    """The admin console's own state: its password, who is logged in, who guessed wrong."""

    password: PasswordCheck
    sessions: SessionStore
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    @classmethod
    def from_config(cls, cfg: AdminConfig) -> Console:
        return cls(PasswordCheck(cfg.password_hash, cfg.password), SessionStore(cfg.session_ttl_s))
