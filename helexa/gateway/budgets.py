"""Budgets that are never overshot, by any number of gateways on one database: reserve a
request's upper bound before it is sent, settle it to what it really used after.

A reservation is a row in `reservations`, written by an atomic conditional step (the
books' writer, ledger.py): lock the key (PostgreSQL: its `api_keys` row FOR UPDATE;
SQLite: the transaction is BEGIN IMMEDIATE), read what it spent (its lifetime total in
`key_spend`, or its ledger rows in a rolling window) and what is reserved against it, and
insert the reservation only if the request's bound still fits under the cap. Settling
deletes the reservation and writes the ledger row in one transaction.

Each reservation names the gateway holding it. A gateway renews one lease for all of its
reservations (its `gateway_instances` heartbeat); when it stops (SIGKILL, a lost host),
any gateway books its reservations as spent at their reserved amount: never undercounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection, bindparam, delete, func, insert, select, update

from helexa.db.models import ApiKey, GatewayInstance, KeySpend, SpendRecord
from helexa.db.models import Reservation as ReservationRow
from helexa.errors import HelexaError, insufficient_quota, rate_limit_exceeded, service_unavailable
from helexa.gateway.keys import BudgetInfo, KeyInfo, as_utc
from helexa.gateway.ledger import (
    BookRow,
    DatabaseUnavailable,
    Ledger,
    book_row,
)
from helexa.protocol.images import ImageEstimate, estimate_images
from helexa.protocol.wire import CHARS_PER_TOKEN, cost_usd, output_room

log = logging.getLogger(__name__)

# Chat templates add tokens the request text does not show (role markers, default system
# prompts): reserved on top of the ~4 characters a token estimate.
TEMPLATE_MARGIN_TOKENS = 64
DATABASE_RETRY_AFTER_S = 2
# A key whose cap is reached only with its in-flight requests' reservations: those settle to
# what they used as their answers end (usually less than reserved), so the refusal is
# temporary and says when to try again
HELD_RETRY_AFTER_S = 1
LEASE_EXPIRED = "lease_expired"  # a ledger row's finish_reason for a reservation booked whole
INSTANCE_FORGOTTEN_AFTER = timedelta(days=1)


def estimate_prompt_tokens(body: bytes) -> int:
    """An upper-bound-leaning estimate of a request's prompt tokens, from its JSON size;
    images count as their tokens, not as their base64 (a 1 MB screenshot is some hundreds
    of tokens, not 350k)."""
    images = ImageEstimate()
    if b"image" in body:  # only then is the body worth parsing for its image parts
        with contextlib.suppress(ValueError):  # not JSON: the node will say so
            images = estimate_images(json.loads(body))
    num_chars = max(0, len(body) - images.num_chars)
    return math.ceil(num_chars / CHARS_PER_TOKEN) + images.num_tokens + TEMPLATE_MARGIN_TOKENS


@dataclass(slots=True)
class Reservation:
    id: str
    key_id: str
    tokens: int  # prompt + max_output × n
    cost: float
    max_output: int  # what each choice may generate now (its max_tokens, maybe lowered)
    n: int = 1
    purse: object | None = None  # the purse it was drawn from (purses.py), not a row


@dataclass(slots=True, frozen=True)
class Refused:
    """Not even one output token fits; for a rolling window, when the oldest spend leaves;
    `held`: it would fit but for the reservations of requests still in flight."""

    oldest: datetime | None
    held: int = 0  # tokens those reservations hold


def database_unavailable(why: str) -> HelexaError:
    return service_unavailable(
        f"the gateway's database is not answering ({why}); metered keys are refused until "
        "it is back, retry shortly",
        DATABASE_RETRY_AFTER_S,
    )


class Drawing(Protocol):
    """What the budgets ask of the purses requests draw on (purses.Purses)."""

    async def draw(
        self,
        key: KeyInfo,
        model: str,
        prompt_tokens: int,
        max_output: int,
        price: tuple[float, float],
        n: int = 1,
    ) -> Reservation | None: ...

    def settle_op(self, res: Reservation, row: dict[str, Any]) -> Callable[[Connection], Any]: ...

    def release(self, res: Reservation) -> None: ...

    def done(self, res: Reservation) -> None: ...

    def outstanding(self) -> tuple[int, float]: ...

    def retire_idle(self) -> None: ...


class Budgets:
    def __init__(
        self, ledger: Ledger, *, lease_s: float = 30.0, database_timeout_s: float = 2.0
    ) -> None:
        self.ledger = ledger
        self.lease_s = lease_s
        self.timeout_s = database_timeout_s
        self.gateway_id = "gw_" + uuid.uuid4().hex[:24]
        self._live: dict[str, Reservation] = {}  # this gateway's, not yet settled
        # what requests draw on (purses.py, built on this module: it registers itself here)
        self.purses: Drawing | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.expired_booked = 0  # reservations of stopped gateways this one booked

    # -- reserve and settle --------------------------------------------------------------
    async def reserve(
        self,
        key: KeyInfo,
        model: str,
        prompt_tokens: int,
        max_output: int,
        price: tuple[float, float],  # USD per 1M input, output tokens
        n: int = 1,
    ) -> Reservation | None:
        """Reserve `prompt_tokens + max_output × n` (lowering max_output to what the cap
        leaves); None when the key has no budget. 429 when not even one output token per
        choice fits; 503 when the database does not answer in time."""
        budget = key.budget
        if budget is None:
            return None
        rid = "rsv_" + uuid.uuid4().hex
        run = _reserve_op(
            rid, self.gateway_id, key, budget, model, prompt_tokens, max_output, n, price
        )
        try:
            got = await self.ledger.write(
                run, timeout=self.timeout_s, lock=key.id, abandoned=self._undo(rid)
            )
        except DatabaseUnavailable as e:
            raise database_unavailable(str(e)) from None
        if isinstance(got, Refused):
            raise over_cap(budget, got.oldest, got.held)
        out, tokens, cost = got
        res = Reservation(rid, key.id, tokens, cost, out, n)
        self._live[rid] = res
        return res

    def settle_op(
        self, res: Reservation | None, row: dict[str, Any]
    ) -> Callable[[Connection], Any]:
        """The op that replaces the reservation (if any) by the request's ledger row."""
        if res is not None:
            self._live.pop(res.id, None)
            return lambda s: _settle(s, res.id, row)
        return BookRow(row)

    def release_op(self, res: Reservation) -> Callable[[Connection], Any]:
        """The op that drops a reservation whose request ran no model: nothing to book."""
        self._live.pop(res.id, None)
        return lambda s: _release(s, res.id)

    def settle(
        self, res: Reservation | None, row: dict[str, Any], lock: str
    ) -> asyncio.Future[Any]:
        """Queue the request's ledger row in place of its reservation, or of its draw on a
        purse; the future is answered once it is durable."""
        if res is None or res.purse is None:
            return self.ledger.submit(self.settle_op(res, row), keep=True, lock=lock)
        purses = self.drawing()
        future = self.ledger.submit(purses.settle_op(res, row), keep=True, lock=lock)
        purses.done(res)  # the purse's retirement, if any, queued behind it
        return future

    def release(self, res: Reservation, lock: str) -> asyncio.Future[Any] | None:
        """A request on which no model ran gives its reservation back (None: a draw on a
        purse, nothing to write)."""
        if res.purse is None:
            return self.ledger.submit(self.release_op(res), keep=True, lock=lock)
        purses = self.drawing()
        purses.release(res)
        purses.done(res)
        return None

    def drawing(self) -> Drawing:
        """The purses requests draw on (build_gateway gives every gateway's budgets theirs)."""
        assert self.purses is not None, "Purses(budgets) registers them before any draw"
        return self.purses

    def outstanding(self) -> tuple[int, float]:
        """Tokens and cost this gateway holds reserved for requests in flight and has not
        settled (a purse's free part is not: no request holds it)."""
        live = self._live.values()
        drawn_tokens, drawn_cost = self.purses.outstanding() if self.purses else (0, 0.0)
        return (
            sum(r.tokens for r in live) + drawn_tokens,
            sum(r.cost for r in live) + drawn_cost,
        )

    def _undo(self, rid: str) -> Callable[[Any], None]:
        """A reservation that was written after its caller gave up: released again."""

        def undo(result: Any) -> None:
            if not isinstance(result, Refused):
                self.ledger.submit(lambda s: _release(s, rid), keep=True)

        return undo

    # -- the lease -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._renew(), name="budget-lease")

    async def _renew(self) -> None:
        """Renew this gateway's lease, and book the reservations of gateways whose lease
        ran out, every quarter lease."""
        host, pid = socket.gethostname()[:200], os.getpid()
        while not self._stopping:
            try:
                await self.ledger.write(
                    lambda s: _heartbeat(s, self.gateway_id, host, pid), timeout=self.lease_s
                )
                self.expired_booked += await self.ledger.write(
                    lambda s: _expire(s, self.lease_s), timeout=self.lease_s
                )
            except DatabaseUnavailable as e:
                log.warning("could not renew this gateway's reservation lease: %s", e)
            except Exception:
                log.exception("renewing the reservation lease failed")
            await asyncio.sleep(self.lease_s / 4)

    async def stop(self) -> None:
        """Stop renewing the lease (the ledger is closed after: idle purses' rows are
        deleted with the last writes)."""
        if self.purses is not None:
            self.purses.retire_idle()
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


# The reservation's statements, built once (a statement built per call costs more than
# SQLite's own work on it).
_LOCK_KEY = select(ApiKey.id).where(ApiKey.id == bindparam("key_id")).with_for_update()
_SPENT = select(KeySpend.tokens, KeySpend.cost_usd).where(KeySpend.key_id == bindparam("key_id"))
_SPENT_SINCE = select(
    func.coalesce(func.sum(SpendRecord.prompt_tokens + SpendRecord.completion_tokens), 0),
    func.coalesce(func.sum(SpendRecord.cost_usd), 0.0),
    func.min(SpendRecord.ts),
).where(SpendRecord.key_id == bindparam("key_id"), SpendRecord.ts >= bindparam("since"))
_RESERVED = select(
    func.coalesce(func.sum(ReservationRow.prompt_tokens + ReservationRow.output_tokens), 0),
    func.coalesce(func.sum(ReservationRow.cost_usd), 0.0),
).where(ReservationRow.key_id == bindparam("key_id"))
_INSERT_RESERVATION = insert(ReservationRow.__table__)
_DELETE_RESERVATION = delete(ReservationRow.__table__).where(
    ReservationRow.__table__.c.id == bindparam("rid")
)


@dataclass(slots=True, frozen=True)
class Left:
    """What a key's cap leaves, read under its lock: None for a dimension it does not cap."""

    tokens: int | None
    cost: float | None
    reserved_tokens: int  # of what is used up, the part only reserved (in flight)
    reserved_cost: float
    oldest: datetime | None  # a rolling window's oldest spend in it


def read_left(conn: Connection, key: KeyInfo, budget: BudgetInfo, now: datetime) -> Left:
    """Lock the key's books (PostgreSQL: its row; SQLite's BEGIN IMMEDIATE locked them all)
    and read what its cap leaves after its spend and every gateway's reservations: no other
    reservation for it, from any gateway, reads the books until this transaction commits."""
    if conn.dialect.name != "sqlite":
        conn.execute(_LOCK_KEY, {"key_id": key.id})
    oldest = None
    if budget.window == "rolling" and budget.window_seconds:
        since = now - timedelta(seconds=budget.window_seconds)
        spent_tokens, spent_cost, oldest = conn.execute(
            _SPENT_SINCE, {"key_id": key.id, "since": since}
        ).one()
    else:
        spent = conn.execute(_SPENT, {"key_id": key.id}).one_or_none()
        spent_tokens, spent_cost = spent if spent is not None else (0, 0.0)
    reserved_tokens, reserved_cost = conn.execute(_RESERVED, {"key_id": key.id}).one()
    tokens_left = cost_left = None
    if budget.cap_tokens is not None:
        tokens_left = budget.cap_tokens - int(spent_tokens) - int(reserved_tokens)
    if budget.cap_cost_usd is not None:
        cost_left = budget.cap_cost_usd - float(spent_cost) - float(reserved_cost)
    return Left(
        tokens_left,
        cost_left,
        int(reserved_tokens),
        float(reserved_cost),
        None if oldest is None else as_utc(oldest),
    )


def refused(
    left: Left, prompt_tokens: int, n: int, price: tuple[float, float], credit: tuple[int, float]
) -> Refused:
    """Not one output token per choice fits: whether it would but for the reservations of
    requests in flight (`credit`: the caller's own share of them, which it offers)."""
    held_tokens = max(0, left.reserved_tokens - credit[0])
    held_cost = max(0.0, left.reserved_cost - credit[1])
    unheld = output_room(
        prompt_tokens,
        None if left.tokens is None else left.tokens + credit[0] + held_tokens,
        None if left.cost is None else left.cost + credit[1] + held_cost,
        *price,
    )
    held = held_tokens if unheld is None or unheld // n >= 1 else 0
    return Refused(left.oldest, held)


def _reserve_op(
    rid: str,
    gateway_id: str,
    key: KeyInfo,
    budget: BudgetInfo,
    model: str,
    prompt_tokens: int,
    max_output: int,
    n: int,
    price: tuple[float, float],
) -> Callable[[Connection], Any]:
    def run(conn: Connection) -> tuple[int, int, float] | Refused:
        now = datetime.now(UTC)
        left = read_left(conn, key, budget, now)
        room = output_room(prompt_tokens, left.tokens, left.cost, *price)
        out = max_output if room is None else min(max_output, room // n)
        if out < 1:
            return refused(left, prompt_tokens, n, price, (0, 0.0))
        tokens, cost = prompt_tokens + out * n, cost_usd(prompt_tokens, out * n, *price)
        conn.execute(
            _INSERT_RESERVATION,
            [
                {
                    "id": rid,
                    "key_id": key.id,
                    "account_id": key.account_id,
                    "gateway_id": gateway_id,
                    "model": model,
                    "prompt_tokens": prompt_tokens,
                    "output_tokens": out * n,
                    "cost_usd": cost,
                    "created_at": now,
                }
            ],
        )
        return out, tokens, cost

    return run


def _settle(conn: Connection, rid: str, row: dict[str, Any]) -> bool:
    """The reservation replaced by the request's ledger row; False (and nothing written)
    when its lease had run out and another gateway booked it whole already."""
    if conn.execute(_DELETE_RESERVATION, {"rid": rid}).rowcount == 0:
        log.warning(
            "reservation %s was booked whole when its gateway's lease ran out; its request's "
            "own row (%s tokens) is not booked again",
            rid,
            (row.get("prompt_tokens") or 0) + (row.get("completion_tokens") or 0),
        )
        return False
    book_row(conn, row)
    return True


def _release(conn: Connection, rid: str) -> None:
    conn.execute(_DELETE_RESERVATION, {"rid": rid})


def _heartbeat(conn: Connection, gateway_id: str, host: str, pid: int) -> None:
    now = datetime.now(UTC)
    done = conn.execute(
        update(GatewayInstance).where(GatewayInstance.id == gateway_id).values(heartbeat_at=now)
    )
    if done.rowcount == 0:
        conn.execute(
            insert(GatewayInstance.__table__),
            [{"id": gateway_id, "host": host, "pid": pid, "started_at": now, "heartbeat_at": now}],
        )


def _expire(conn: Connection, lease_s: float) -> int:
    """Book every reservation whose gateway's lease ran out as spent, at its reserved
    amount; the count booked."""
    now = datetime.now(UTC)
    stale = now - timedelta(seconds=lease_s)
    live = select(GatewayInstance.id).where(GatewayInstance.heartbeat_at >= stale)
    rows = conn.execute(
        select(ReservationRow.__table__)
        .where(ReservationRow.gateway_id.not_in(live), ReservationRow.created_at < stale)
        .with_for_update(skip_locked=True)
    ).all()
    booked = 0
    for r in rows:
        if conn.execute(_DELETE_RESERVATION, {"rid": r.id}).rowcount:
            row = {
                "ts": now,
                "account_id": r.account_id,
                "key_id": r.key_id,
                "model": r.model,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.output_tokens,
                "cost_usd": r.cost_usd,
                "status": 0,
                "finish_reason": LEASE_EXPIRED,
            }
            book_row(conn, row)
            booked += 1
    if booked:
        log.warning("booked %d reservations of stopped gateways at their reserved amount", booked)
    conn.execute(
        delete(GatewayInstance).where(GatewayInstance.heartbeat_at < now - INSTANCE_FORGOTTEN_AFTER)
    )
    return booked


def over_cap(budget: BudgetInfo, oldest: datetime | None, held: int = 0) -> HelexaError:
    """429: the key's cap reached. `held`: reached only with the reservations of its
    requests still in flight, which settle to what they used as they end: the refusal says
    so, and a balance's carries Retry-After (a rolling window's names when its oldest spend
    leaves, as when nothing is held)."""
    in_flight = (
        f"; {held} of its tokens are only reserved by its requests still in flight, and "
        "what those do not use frees as they finish"
        if held
        else ""
    )
    if budget.window != "rolling" or not budget.window_seconds:
        if held:
            return HelexaError(
                429,
                "insufficient_quota",
                f"this key's budget is held, not spent ({budget.describe()}){in_flight}: "
                "retry shortly",
                code="insufficient_quota",
                retry_after=HELD_RETRY_AFTER_S,
            )
        return insufficient_quota(
            f"this key's budget is spent ({budget.describe()}); ask for a higher cap or another key"
        )
    now = datetime.now(UTC)
    leaves = (oldest or now) + timedelta(seconds=budget.window_seconds)
    retry = max(1.0, (leaves - now).total_seconds())
    return rate_limit_exceeded(
        f"this key's budget for the rolling window is used up ({budget.describe()}){in_flight}; "
        "room frees as older requests leave the window",
        retry,
    )
