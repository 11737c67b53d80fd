"""Admission: how many requests a model runs at once, how many wait, for how long, and how
many one principal may hold (docs/node.md § Admission).

Everything here runs on the event loop: no locks, and a rejection costs no more than a few
dictionary lookups, so an overloaded node answers 503/429 at once instead of stalling.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from dataclasses import dataclass

from helexa.errors import HelexaError, rate_limit_exceeded

# Retry-After bounds in seconds: never "retry now", never "come back in an hour".
MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0


@dataclass(slots=True, frozen=True)
class AdmissionLimits:
    max_running: int
    max_waiting: int
    max_wait_s: float
    per_principal_max: int  # 0: no per-principal cap


class Permit:
    """One admitted request; `release()` (or leaving the `async with`) frees its slot."""

    __slots__ = ("_admission", "_principal", "_released", "_started")

    def __init__(self, admission: Admission, principal: str | None) -> None:
        self._admission = admission
        self._principal = principal
        self._started = time.monotonic()
        self._released = False

    @property
    def is_released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self._principal, time.monotonic() - self._started)

    async def __aenter__(self) -> Permit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """A bounded running set plus a bounded FIFO queue with a maximum wait, per model."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.num_running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._by_principal: Counter[str] = Counter()
        # Smoothed request duration: the basis of Retry-After.
        self._avg_duration_s = 2.0

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def held_by(self, principal: str) -> int:
        return self._by_principal[principal]

    def check(self, principal: str | None = None) -> None:
        """Raise now what `acquire` would raise at once: the principal's cap or a full queue."""
        cap = self.limits.per_principal_max
        if principal is not None and cap and self._by_principal[principal] >= cap:
            raise rate_limit_exceeded(
                f"too many concurrent requests for this key: {cap} running or queued is the "
                "limit per principal; retry when one finishes",
                self._retry_after(1),
                status=429,
            )
        must_queue = self.num_running >= self.limits.max_running or self._waiters
        if must_queue and len(self._waiters) >= self.limits.max_waiting:
            raise self._overloaded("the request queue is full")

    async def acquire(self, principal: str | None = None) -> Permit:
        """A permit once a running slot is free; raises the 503/429 `HelexaError` when the
        queue is full, the wait runs out, or `principal` already holds its share."""
        self.check(principal)
        if self.num_running < self.limits.max_running and not self._waiters:
            self.num_running += 1
            return self._grant(principal)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._hold(principal)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.limits.max_wait_s)
        except BaseException as e:  # timeout, or the client went away while queued
            self._unhold(principal)
            if waiter.done() and not waiter.cancelled():
                self._release(None, None)  # the slot was handed over just now: pass it on
            else:
                waiter.cancel()
                self._remove_waiter(waiter)
            if isinstance(e, TimeoutError):
                raise self._overloaded(
                    f"no capacity within {self.limits.max_wait_s:g}s of queueing"
                ) from None
            raise
        return Permit(self, principal)  # num_running was kept for us by _release

    def _grant(self, principal: str | None) -> Permit:
        self._hold(principal)
        return Permit(self, principal)

    def _hold(self, principal: str | None) -> None:
        if principal is not None:
            self._by_principal[principal] += 1

    def _unhold(self, principal: str | None) -> None:
        if principal is not None:
            self._by_principal[principal] -= 1
            if self._by_principal[principal] <= 0:
                del self._by_principal[principal]

    def _release(self, principal: str | None, duration_s: float | None) -> None:
        self._unhold(principal)
        if duration_s is not None:
            self._avg_duration_s = 0.8 * self._avg_duration_s + 0.2 * duration_s
        # Hand the slot straight to the first live waiter, so num_running never dips and
        # a newcomer cannot overtake the queue.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_running -= 1
        assert self.num_running >= 0, self.num_running

    def _remove_waiter(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _overloaded(self, why: str) -> HelexaError:
        ahead = len(self._waiters) + 1
        return rate_limit_exceeded(
            f"the model is overloaded ({why}); retry after the Retry-After delay",
            self._retry_after(ahead),
            status=503,
        )

    def _retry_after(self, ahead: int) -> float:
        """Roughly when a slot frees: `ahead` requests drained `max_running` at a time."""
        estimate = self._avg_duration_s * ahead / max(1, self.limits.max_running)
        return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, estimate))
