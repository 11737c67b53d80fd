"""Admission: how many requests a model runs at once, how many wait, for how long, and in
what order the waiting ones are served (docs/node.md § Admission).

Every request belongs to a *lane*: a gateway key (`account/key`, as the gateway stamps it),
an anonymous direct caller's address (`client:<address>`), or the gateway's anonymous
traffic (one lane). When every running slot is taken, requests wait in their lane, and a
freed slot goes to the waiting lane that has the fewest requests running (ties: the lane
whose oldest waiter came first). One lane's burst therefore cannot starve another: a
newcomer runs at the next freed slot, however many the busy lane has queued. A full queue
makes room for a lighter lane by turning away the newest waiter of the heaviest one.

A hard cap per gateway key (`per_principal_max`) is available, off by default: callers
without a key (direct clients, anonymous gateway traffic) are never capped, so a plain
client's concurrent requests are served as vLLM, llama-server and Ollama serve them.

Everything here runs on the event loop: no locks, and a refusal costs no more than a few
dictionary lookups, so an overloaded node answers 503/429 at once instead of stalling.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass

from helexa.errors import HelexaError, rate_limit_exceeded

# Retry-After bounds in seconds: never "retry now", never "come back in an hour".
MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0
# How a direct caller without a key is named: by its address, for fair shares only.
DIRECT_PREFIX = "client:"
ANONYMOUS_LANE = ""  # the gateway's anonymous traffic


def direct_caller(address: str | None) -> str:
    """The principal of a caller that named no key: its client address."""
    return f"{DIRECT_PREFIX}{address or '?'}"


def is_keyed(principal: str | None) -> bool:
    """Whether `principal` is a gateway key, the only kind the hard cap applies to."""
    return principal is not None and not principal.startswith(DIRECT_PREFIX)


@dataclass(slots=True, frozen=True)
class AdmissionLimits:
    max_running: int
    max_waiting: int
    max_wait_s: float
    per_principal_max: int  # 0: no per-key cap


class Permit:
    """One admitted request; `release()` (or leaving the `async with`) frees its slot."""

    __slots__ = ("_admission", "_lane", "_released", "_started")

    def __init__(self, admission: Admission, lane: str) -> None:
        self._admission = admission
        self._lane = lane
        self._started = time.monotonic()
        self._released = False

    @property
    def is_released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self._lane, time.monotonic() - self._started)

    async def __aenter__(self) -> Permit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _Waiter:
    """A queued request: resolved with True when handed a slot, or with the refusal when a
    lighter lane pushed it out of a full queue."""

    __slots__ = ("future", "lane", "seq")

    def __init__(self, lane: str, seq: int) -> None:
        self.future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.lane = lane
        self.seq = seq


class Admission:
    """A bounded running set plus a bounded queue with a maximum wait, per model, whose
    freed slots go to the waiting lane with the fewest requests running."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.num_running = 0
        self._queues: dict[str, deque[_Waiter]] = {}  # lane → its waiters, oldest first
        self._num_waiting = 0
        self._running: Counter[str] = Counter()  # lane → requests running
        self._held: Counter[str] = Counter()  # lane → requests running or queued
        self._seq = itertools.count()
        # Smoothed request duration: the basis of Retry-After.
        self._avg_duration_s = 2.0

    @property
    def queue_depth(self) -> int:
        return self._num_waiting

    def held_by(self, principal: str | None) -> int:
        """Requests `principal` has running or queued."""
        return self._held[_lane(principal)]

    def check(self, principal: str | None = None) -> None:
        """Raise now what `acquire` would raise at once: a key's cap, or a full queue with
        no heavier lane to make room."""
        lane = _lane(principal)
        cap = self.limits.per_principal_max
        if cap and is_keyed(principal) and self._held[lane] >= cap:
            raise rate_limit_exceeded(
                f"too many concurrent requests for this key: {cap} running or queued is the "
                "limit per key ([node] per_principal_max); retry when one finishes",
                self._retry_after(1),
                status=429,
            )
        full = self._must_queue() and self._num_waiting >= self.limits.max_waiting
        if full and self._heaviest_above(lane) is None:
            raise self._overloaded("the request queue is full")

    async def acquire(self, principal: str | None = None) -> Permit:
        """A permit once a running slot is free; raises the 503/429 `HelexaError` when the
        queue is full, the wait runs out, or a keyed `principal` already holds its cap."""
        self.check(principal)
        lane = _lane(principal)
        if not self._must_queue():
            self.num_running += 1
            self._running[lane] += 1
            self._held[lane] += 1
            return Permit(self, lane)
        waiter = self._enqueue(lane)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.limits.max_wait_s)
        except BaseException as e:  # timeout, pushed out, or the client went away
            self._leave(waiter)
            if isinstance(e, TimeoutError):
                raise self._overloaded(
                    f"no capacity within {self.limits.max_wait_s:g}s of queueing"
                ) from None
            raise
        return Permit(self, lane)  # num_running and the lane's count were kept by _hand_over

    def _must_queue(self) -> bool:
        return self.num_running >= self.limits.max_running or self._num_waiting > 0

    def _enqueue(self, lane: str) -> _Waiter:
        if self._num_waiting >= self.limits.max_waiting:
            heaviest = self._heaviest_above(lane)
            assert heaviest is not None, "check() let a full queue through"
            self._push_out(heaviest)
        waiter = _Waiter(lane, next(self._seq))
        self._queues.setdefault(lane, deque()).append(waiter)
        self._num_waiting += 1
        self._held[lane] += 1
        return waiter

    def _heaviest_above(self, lane: str) -> str | None:
        """The waiting lane holding the most, if it holds at least two more than `lane`
        would: only then does pushing its newest waiter out make the shares fairer."""
        heaviest = max(self._queues, key=lambda q: self._held[q], default=None)
        if heaviest is None or self._held[heaviest] < self._held[lane] + 2:
            return None
        return heaviest

    def _push_out(self, lane: str) -> None:
        waiter = self._queues[lane].pop()
        self._forget(waiter)
        waiter.future.set_exception(
            self._overloaded("the request queue is full and this caller holds the most of it")
        )

    def _leave(self, waiter: _Waiter) -> None:
        """`waiter` stops waiting (timed out, cancelled, pushed out): if a slot was handed
        to it meanwhile, pass the slot on; if it is still queued, leave the queue."""
        done = waiter.future.done() and not waiter.future.cancelled()
        if done and waiter.future.exception() is None:
            self._release(waiter.lane, None)  # handed a slot just now: pass it on
            return
        if not done:
            waiter.future.cancel()
            queue = self._queues.get(waiter.lane)
            if queue is not None and waiter in queue:
                queue.remove(waiter)
                self._forget(waiter)

    def _forget(self, waiter: _Waiter) -> None:
        """Bookkeeping for a waiter that left the queue without a slot."""
        self._num_waiting -= 1
        self._drop_held(waiter.lane)
        if not self._queues[waiter.lane]:
            del self._queues[waiter.lane]

    def _drop_held(self, lane: str) -> None:
        self._held[lane] -= 1
        if self._held[lane] <= 0:
            del self._held[lane]

    def _release(self, lane: str, duration_s: float | None) -> None:
        self._running[lane] -= 1
        if self._running[lane] <= 0:
            del self._running[lane]
        self._drop_held(lane)
        if duration_s is not None:
            self._avg_duration_s = 0.8 * self._avg_duration_s + 0.2 * duration_s
        # Hand the slot straight to the next waiter, so num_running never dips and a
        # newcomer cannot overtake the queue.
        if not self._hand_over():
            self.num_running -= 1
            assert self.num_running >= 0, self.num_running

    def _hand_over(self) -> bool:
        """Give a freed slot to the oldest waiter of the lane with the fewest running.
        Every queued waiter is still waiting: one leaves the queue in the same call that
        ends its wait (`_leave`, `_push_out`)."""
        if not self._queues:
            return False
        lane = min(self._queues, key=lambda q: (self._running[q], self._queues[q][0].seq))
        queue = self._queues[lane]
        waiter = queue.popleft()
        self._num_waiting -= 1
        if not queue:
            del self._queues[lane]
        assert not waiter.future.done(), "a waiter that stopped waiting was left queued"
        self._running[lane] += 1
        waiter.future.set_result(True)
        return True

    def _overloaded(self, why: str) -> HelexaError:
        ahead = self._num_waiting + 1
        return rate_limit_exceeded(
            f"the model is overloaded ({why}); retry after the Retry-After delay",
            self._retry_after(ahead),
            status=503,
        )

    def _retry_after(self, ahead: int) -> float:
        """Roughly when a slot frees: `ahead` requests drained `max_running` at a time."""
        estimate = self._avg_duration_s * ahead / max(1, self.limits.max_running)
        return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, estimate))


def _lane(principal: str | None) -> str:
    return ANONYMOUS_LANE if principal is None else principal
