"""A key's budget held by this gateway a share at a time: the reservation's round trip to
the database paid once per share, not once per request.

An exact reservation (budgets.py) costs every metered request one awaited transaction
before its first byte. A purse is instead one `reservations` row per key and gateway,
holding a share of the key's cap for this gateway. Requests draw their upper bound from it
in memory; only a request the purse cannot cover goes to the database, where the grow op
reads the key's books under its lock exactly as a reservation does, lowers the request's
max_tokens to what the cap leaves, and grows the row by what the request needs plus
headroom. Settling a request books its ledger row and takes what it used out of the row in
one transaction, and gives the rest of its bound back to the purse.

What keeps a cap unpassable, with any number of gateways on one database:
- the row always holds at least what this gateway has promised and not yet booked: the
  purse's free part + the bounds of its requests in flight + what requests that ended used
  and whose settlement is still queued. Every other gateway's reservation reads the row, so
  spent + reserved never falls below what the key has really used plus what is in flight;
- the row only grows inside the grow op, which checks the cap under the key's lock;
- a request waiting for the row to grow offers the purse's free part to the op (and the op
  counts it as the request's), so two ops never both count the same free tokens.

Headroom is about a second of the key's recent use here (at least `HEADROOM_REQUESTS`
requests like this one) and never more than `1 / HEADROOM_SHARE` of what the cap leaves,
so near a cap a purse shrinks to each request's own bound (the exact reservation again) and
leaves the rest to other gateways. Once less than that is free, the purse is topped
up in the background (nobody waits: requests draw on the rest meanwhile), so a busy key's
requests reach the database only when a burst outruns the headroom. A purse whose requests have all ended is retired with
the settlements queued with it (the row deleted); a request that arrives before that batch
is taken revives it. The price of the round trips saved: a gateway killed while holding a
purse has its row booked whole when its lease runs out (budgets.py), its free part
included: at most about one second of the key's use, charged and never undercounted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, bindparam, delete, insert, update

from helexa.db.models import Reservation as ReservationRow
from helexa.gateway.budgets import (
    Refused,
    Reservation,
    database_unavailable,
    over_cap,
    read_left,
    refused,
)
from helexa.gateway.keys import BudgetInfo, KeyInfo
from helexa.gateway.ledger import BookRow, DatabaseUnavailable, Deferred
from helexa.logs import new_id
from helexa.protocol.wire import cost_usd, output_room

if TYPE_CHECKING:
    from helexa.gateway.budgets import Budgets

log = logging.getLogger(__name__)

HEADROOM_REQUESTS = 4  # a purse grows by at least this many bounds like the asking one
HEADROOM_S = 1.0  # ... or by the tokens the key used here in about this long
HEADROOM_SHARE = 8  # ... but never by more than this fraction of what the cap leaves
# a purse with nothing in flight for this long is retired with the next batch of writes
RETIRE_IDLE_S = 0.05

_ROWS = ReservationRow.__table__
_GROW = (
    update(_ROWS)
    .where(_ROWS.c.id == bindparam("pid"))
    .values(
        output_tokens=_ROWS.c.output_tokens + bindparam("tokens"),
        cost_usd=_ROWS.c.cost_usd + bindparam("cost"),
    )
)
_INSERT = insert(_ROWS)
_DROP = delete(_ROWS).where(_ROWS.c.id == bindparam("pid"))


class _Lost:
    """The purse's row is gone: booked whole by another gateway while this one's lease had
    run out. Its free part is nothing any more; a new purse starts from the books."""


LOST = _Lost()


@dataclass(slots=True, eq=False)
class Purse:
    id: str  # its `reservations` row
    key_id: str
    budget: BudgetInfo  # the cap it was drawn under: a changed cap starts a new purse
    free_tokens: int = 0  # held by the row, promised to no request
    free_cost: float = 0.0
    held_tokens: int = 0  # the bounds of its requests in flight
    held_cost: float = 0.0
    users: int = 0  # requests in flight on it, or waiting for it to grow
    written: bool = False  # its row exists
    retired: bool = False  # its row is (being) deleted, or lost: no more draws
    revivals: int = 0  # a retirement queued before the latest draw no longer applies
    idle_since: float = 0.0  # when its last request ended
    topping: asyncio.Future[Any] | None = None  # a top-up (headroom only) on its way
    since: float = field(default_factory=time.monotonic)
    used: int = 0  # tokens its requests used since `since`

    def fits(self, tokens: int, cost: float) -> bool:
        return self.free_tokens >= tokens and self.free_cost >= cost

    def headroom(self, need: int) -> int:
        """Tokens to grow by past a request's need: about `HEADROOM_S` of recent use, and
        at least `HEADROOM_REQUESTS` bounds like this one or two per request in flight."""
        now = time.monotonic()
        span = now - self.since
        per_s = self.used / max(span, HEADROOM_S)
        if span > 4 * HEADROOM_S:  # the rate of the last few seconds, not of all time
            self.since, self.used = now, 0
        return max(max(HEADROOM_REQUESTS, 2 * self.users) * need, int(per_s * HEADROOM_S))


class Purses:
    """This gateway's purses, one per metered key in use (budgets.py holds it)."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.ledger = budgets.ledger
        self._current: dict[str, Purse] = {}  # by key id: where its next request draws
        self._open: dict[str, Purse] = {}  # by purse id: every purse not yet retired
        self.grows = 0  # grow ops a request waited for (a round trip on its path)
        self.top_ups = 0  # grow ops nobody waited for
        budgets.purses = self  # settlements and the metrics reach the purses through it

    async def draw(
        self,
        key: KeyInfo,
        model: str,
        prompt_tokens: int,
        max_output: int,
        price: tuple[float, float],
        n: int = 1,
    ) -> Reservation | None:
        """Reserve `prompt_tokens + max_output × n` from the key's purse (lowering
        max_output to what the cap leaves), going to the database only when the purse is
        short; None when the key has no budget. Refusals as `Budgets.reserve`."""
        budget = key.budget
        if budget is None:
            return None
        purse = self._purse(key, budget)
        tokens, cost = (
            prompt_tokens + max_output * n,
            cost_usd(prompt_tokens, max_output * n, *price),
        )
        purse.users += 1
        purse.revivals += 1
        if purse.topping is not None and not purse.fits(tokens, cost):
            try:  # short while a top-up is on its way: wait for it, not a round trip more
                await asyncio.wait([purse.topping])
            except BaseException:
                self._leave(purse)
                raise
        if purse.fits(tokens, cost):
            purse.free_tokens -= tokens
            purse.free_cost -= cost
            self._top_up(purse, key, budget, model, price, tokens)
            return self._hold(purse, tokens, cost, max_output, n)
        try:
            got = await self._grow(purse, key, budget, model, prompt_tokens, max_output, n, price)
        except BaseException:
            self._leave(purse)
            raise
        if got is LOST:  # once: the new purse's row is fresh
            self._leave(purse)
            return await self.draw(key, model, prompt_tokens, max_output, price, n)
        out, need_tokens, need_cost = got
        return self._hold(purse, need_tokens, need_cost, out, n)

    async def _grow(
        self,
        purse: Purse,
        key: KeyInfo,
        budget: BudgetInfo,
        model: str,
        prompt_tokens: int,
        max_output: int,
        n: int,
        price: tuple[float, float],
    ) -> tuple[int, int, float] | _Lost:
        credit = purse.free_tokens, purse.free_cost  # offered to the op, and to it alone
        purse.free_tokens, purse.free_cost = 0, 0.0
        op = _grow_op(
            purse,
            self.budgets.gateway_id,
            key,
            budget,
            model,
            (prompt_tokens, max_output, n),
            price,
            credit,
            purse.headroom(prompt_tokens + max_output * n),
        )
        try:
            got = await self.ledger.write(
                op,
                timeout=self.budgets.timeout_s,
                lock=key.id,
                abandoned=lambda result: self._granted(purse, result, (0, 0.0)),
            )
        except DatabaseUnavailable as e:
            self._refund(purse, credit)
            raise database_unavailable(str(e)) from None
        except BaseException:
            self._refund(purse, credit)
            raise
        if isinstance(got, Refused):
            self._refund(purse, credit)
            raise over_cap(budget, got.oldest, got.held)
        if got is LOST:
            self._lose(purse)
            return LOST
        out, need_tokens, need_cost, _, _ = got
        self.grows += 1
        self._granted(purse, got, credit)
        purse.free_tokens -= need_tokens
        purse.free_cost -= need_cost
        return out, need_tokens, need_cost

    def _top_up(
        self,
        purse: Purse,
        key: KeyInfo,
        budget: BudgetInfo,
        model: str,
        price: tuple[float, float],
        need: int,
    ) -> None:
        """Grow the purse by its headroom, in the background, once less than that is
        free: requests keep drawing on the rest meanwhile, so that a busy key's requests
        never wait for the database (and never all at once, as when the free part runs
        out under many requests in flight)."""
        if purse.topping is not None or purse.retired:
            return
        headroom = purse.headroom(need)
        if purse.free_tokens >= headroom:
            return
        op = _grow_op(
            purse, self.budgets.gateway_id, key, budget, model, None, price, (0, 0.0), headroom
        )
        # written at once (awaited, for the writer), but nobody waits: it lands in time
        future = self.ledger.submit(op, keep=False, lock=key.id, awaited=True)
        purse.topping = future
        future.add_done_callback(lambda done: self._topped(purse, done))

    def _topped(self, purse: Purse, done: asyncio.Future[Any]) -> None:
        purse.topping = None
        if done.cancelled() or done.exception() is not None:
            return  # the database did not take it: a request short of tokens grows it
        result = done.result()
        if purse.retired:
            return  # its row went after the top-up, with it
        if result is LOST:
            self._lose(purse)
        else:
            self.top_ups += 1
            self._granted(purse, result, (0, 0.0))

    def _granted(self, purse: Purse, result: Any, credit: tuple[int, float]) -> None:
        """The row grew (by the op's grant, which counted `credit` as already in it)."""
        if isinstance(result, tuple):
            purse.written = True
            purse.free_tokens += credit[0] + result[3]
            purse.free_cost += credit[1] + result[4]

    def _refund(self, purse: Purse, credit: tuple[int, float]) -> None:
        purse.free_tokens += credit[0]
        purse.free_cost += credit[1]

    def _hold(self, purse: Purse, tokens: int, cost: float, out: int, n: int) -> Reservation:
        purse.held_tokens += tokens
        purse.held_cost += cost
        return Reservation("rsv_" + new_id(), purse.key_id, tokens, cost, out, n, purse)

    # -- after ---------------------------------------------------------------------------
    def settle_op(self, res: Reservation, row: dict[str, Any]) -> Callable[[Connection], Any]:
        """The op that books the request's row and takes what it used out of its purse's
        row; the rest of its bound is the purse's again at once. Submit it before calling
        `done`, so the purse's retirement is queued behind it."""
        purse = res.purse
        assert purse is not None
        used_tokens = int(row.get("prompt_tokens") or 0) + int(row.get("completion_tokens") or 0)
        used_cost = float(row.get("cost_usd") or 0.0)
        purse.used += used_tokens
        self._unhold(purse, res)
        purse.free_tokens += res.tokens - used_tokens
        purse.free_cost += res.cost - used_cost
        return BookRow(row, take=(purse.id, used_tokens, used_cost))

    def release(self, res: Reservation) -> None:
        """A request on which no model ran: its whole bound is the purse's again (nothing
        to write). Call `done` after."""
        purse = res.purse
        assert purse is not None
        self._unhold(purse, res)
        purse.free_tokens += res.tokens
        purse.free_cost += res.cost

    def done(self, res: Reservation) -> None:
        """The request no longer draws on its purse."""
        assert res.purse is not None
        self._leave(res.purse)

    def _unhold(self, purse: Purse, res: Reservation) -> None:
        purse.held_tokens -= res.tokens
        purse.held_cost -= res.cost

    def outstanding(self) -> tuple[int, float]:
        """The bounds of requests in flight on this gateway's purses."""
        purses = self._open.values()
        return sum(p.held_tokens for p in purses), sum(p.held_cost for p in purses)

    # -- the purses' lives -----------------------------------------------------------------
    def _purse(self, key: KeyInfo, budget: BudgetInfo) -> Purse:
        purse = self._current.get(key.id)
        if purse is not None and not purse.retired and purse.budget == budget:
            return purse
        if purse is not None and not purse.retired:  # its cap changed: no more draws on it
            del self._current[key.id]
            self._retire_later(purse, purse.revivals, idle_s=0.0)
        purse = Purse("prs_" + uuid.uuid4().hex, key.id, budget)
        self._current[key.id] = self._open[purse.id] = purse
        return purse

    def _leave(self, purse: Purse) -> None:
        purse.users -= 1
        if not purse.users and not purse.retired:
            purse.idle_since = time.monotonic()
            self._retire_later(purse, purse.revivals)

    def _retire_later(self, purse: Purse, revivals: int, *, idle_s: float = RETIRE_IDLE_S) -> None:
        """Queue the purse's retirement behind what its requests queued: it happens if, when
        the batch is taken, no request has drawn on it since and it has been idle `idle_s`."""
        if purse.retired or purse.users or purse.revivals != revivals:
            return
        self.ledger.submit(
            Deferred(lambda: self._retire(purse, revivals, idle_s)),
            keep=True,
            lock=purse.key_id,
            quiet=True,
        )

    def _retire(
        self, purse: Purse, revivals: int, idle_s: float
    ) -> Callable[[Connection], Any] | None:
        if purse.retired or purse.users or purse.revivals != revivals:
            return None  # revived: its next idle moment queues another
        wait = idle_s - (time.monotonic() - purse.idle_since)
        if wait > 0:  # back-to-back requests keep it: asked again once it has been idle
            asyncio.get_running_loop().call_later(wait, self._retire_later, purse, revivals)
            return None
        self._forget(purse)
        if not purse.written:
            return None
        pid = purse.id
        return lambda conn: conn.execute(_DROP, {"pid": pid})

    def _lose(self, purse: Purse) -> None:
        log.warning(
            "this gateway's share of key %s's budget was booked whole while its lease had run "
            "out; starting a new one",
            purse.key_id,
        )
        self._forget(purse)

    def _forget(self, purse: Purse) -> None:
        purse.retired = True
        purse.free_tokens, purse.free_cost = 0, 0.0
        self._open.pop(purse.id, None)
        if self._current.get(purse.key_id) is purse:
            del self._current[purse.key_id]

    def retire_idle(self) -> None:
        """At shutdown, once requests are drained: every purse with nothing in flight."""
        for purse in list(self._open.values()):
            self._retire_later(purse, purse.revivals, idle_s=0.0)


def _grow_op(
    purse: Purse,
    gateway_id: str,
    key: KeyInfo,
    budget: BudgetInfo,
    model: str,
    ask: tuple[int, int, int] | None,  # prompt tokens, max output, n; None: headroom only
    price: tuple[float, float],
    credit: tuple[int, float],
    headroom: int,
) -> Callable[[Connection], Any]:
    pid, written = purse.id, purse.written

    def run(conn: Connection) -> tuple[int, int, float, int, float] | Refused | _Lost:
        now = datetime.now(UTC)
        left = read_left(conn, key, budget, now)
        tokens_left = None if left.tokens is None else left.tokens + credit[0]
        cost_left = None if left.cost is None else left.cost + credit[1]
        out = need_tokens = 0
        need_cost = 0.0
        if ask is not None:
            prompt_tokens, max_output, n = ask
            room = output_room(prompt_tokens, tokens_left, cost_left, *price)
            out = max_output if room is None else min(max_output, room // n)
            if out < 1:
                return refused(left, prompt_tokens, n, price, credit)
            need_tokens = prompt_tokens + out * n
            need_cost = cost_usd(prompt_tokens, out * n, *price)
        extra = headroom
        per_token = max(price) / 1e6
        if tokens_left is not None:
            extra = min(extra, max(0, tokens_left - need_tokens) // HEADROOM_SHARE)
        if cost_left is not None and per_token > 0:
            by_cost = max(0.0, cost_left - need_cost) / HEADROOM_SHARE / per_token
            extra = min(extra, int(by_cost))
        grant_tokens = need_tokens + extra - credit[0]
        grant_cost = need_cost + extra * per_token - credit[1]
        if ask is None and extra <= 0:
            return out, 0, 0.0, 0, 0.0  # near the cap: no headroom to take
        grown = conn.execute(_GROW, {"pid": pid, "tokens": grant_tokens, "cost": grant_cost})
        if not grown.rowcount:
            if written:
                return LOST
            conn.execute(
                _INSERT,
                [
                    {
                        "id": pid,
                        "key_id": key.id,
                        "account_id": key.account_id,
                        "gateway_id": gateway_id,
                        "model": model,
                        "prompt_tokens": 0,
                        "output_tokens": grant_tokens,
                        "cost_usd": grant_cost,
                        "created_at": now,
                    }
                ],
            )
        return out, need_tokens, need_cost, grant_tokens, grant_cost

    return run
