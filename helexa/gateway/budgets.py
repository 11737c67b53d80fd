"""Budgets that are never overshot: reserve a request's upper bound before it is sent,
settle to what it really used after.

The books live in this process and every check-and-reserve runs on the event loop without
an await in between, so hundreds of concurrent requests cannot all slip through the same
gap (the gateway is one process per database). Spend recorded before start-up is read from
the ledger the first time a key is seen.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from helexa.db.models import SpendRecord
from helexa.errors import HelexaError, insufficient_quota, rate_limit_exceeded
from helexa.gateway.keys import BudgetInfo, KeyInfo
from helexa.protocol.wire import CHARS_PER_TOKEN, cost_usd, output_room

# Chat templates add tokens the request text does not show (role markers, default system
# prompts): reserved on top of the ~4 characters a token estimate.
TEMPLATE_MARGIN_TOKENS = 64


def estimate_prompt_tokens(body: bytes) -> int:
    """An upper-bound-leaning estimate of a request's prompt tokens, from its JSON size."""
    return math.ceil(len(body) / CHARS_PER_TOKEN) + TEMPLATE_MARGIN_TOKENS


@dataclass(slots=True)
class _Books:
    spent_tokens: int = 0
    spent_cost: float = 0.0
    reserved_tokens: int = 0
    reserved_cost: float = 0.0
    events: deque[tuple[float, int, float]] = field(default_factory=deque)  # rolling only
    rolling: bool = False
    window: tuple[str, int | None] = ("balance", None)  # what the spend above was counted over

    def expire(self, window_s: int, now: float) -> None:
        while self.events and self.events[0][0] <= now - window_s:
            _, tokens, cost = self.events.popleft()
            self.spent_tokens -= tokens
            self.spent_cost -= cost


@dataclass(slots=True)
class Reservation:
    key_id: str
    tokens: int
    cost: float
    max_output: int  # what the request may generate now (its max_tokens, maybe lowered)
    settled: bool = False


class Budgets:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self._books: dict[str, _Books] = {}
        self._loading: dict[str, asyncio.Task[_Books]] = {}

    async def reserve(
        self,
        key: KeyInfo,
        prompt_tokens: int,
        max_output: int,
        price: tuple[float, float],  # USD per 1M input, output tokens
    ) -> Reservation | None:
        """Reserve `prompt_tokens + max_output` (lowering max_output to what the cap leaves);
        None when the key has no budget. Raises 429 when not even one output token fits."""
        budget = key.budget
        if budget is None:
            return None
        books = await self._books_for(key.id, budget)
        # from here to the increment: no await, so the check and the reservation are atomic
        now = time.time()
        if budget.window == "rolling" and budget.window_seconds:
            books.expire(budget.window_seconds, now)
        tokens_left = cost_left = None
        if budget.cap_tokens is not None:
            tokens_left = budget.cap_tokens - books.spent_tokens - books.reserved_tokens
        if budget.cap_cost_usd is not None:
            cost_left = budget.cap_cost_usd - books.spent_cost - books.reserved_cost
        room = output_room(prompt_tokens, tokens_left, cost_left, *price)
        out = max_output if room is None else min(max_output, room)
        if out < 1:
            raise self._over_cap(budget, books, now)
        tokens, cost = prompt_tokens + out, cost_usd(prompt_tokens, out, *price)
        books.reserved_tokens += tokens
        books.reserved_cost += cost
        return Reservation(key.id, tokens, cost, out)

    def settle(self, res: Reservation, tokens: int, cost: float) -> None:
        """Replace the reservation by what the request used (0 if it never ran)."""
        if res.settled:
            return
        res.settled = True
        books = self._books[res.key_id]
        books.reserved_tokens -= res.tokens
        books.reserved_cost -= res.cost
        books.spent_tokens += tokens
        books.spent_cost += cost
        if books.rolling:
            books.events.append((time.time(), tokens, cost))

    def outstanding(self) -> tuple[int, float]:
        """Tokens and cost reserved and not yet settled, over every key."""
        return (
            sum(b.reserved_tokens for b in self._books.values()),
            sum(b.reserved_cost for b in self._books.values()),
        )

    def _over_cap(self, budget: BudgetInfo, books: _Books, now: float) -> HelexaError:
        if budget.window != "rolling" or not budget.window_seconds:
            return insufficient_quota(
                f"this key's budget is spent ({budget.describe()}); "
                "ask for a higher cap or another key"
            )
        oldest = books.events[0][0] if books.events else now
        retry = max(1.0, oldest + budget.window_seconds - now)
        return rate_limit_exceeded(
            f"this key's budget for the rolling window is used up ({budget.describe()}); "
            "room frees as older requests leave the window",
            retry,
        )

    async def _books_for(self, key_id: str, budget: BudgetInfo) -> _Books:
        books = self._books.get(key_id)
        if books is not None and books.window == _window(budget):
            return books
        task = self._loading.get(key_id)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(self._load, key_id, budget))
            self._loading[key_id] = task
        fresh = await asyncio.shield(task)
        self._loading.pop(key_id, None)
        old = self._books.get(key_id)
        if old is not None and old.window != fresh.window:
            # the key's window changed (admin console, CLI): its spend is recounted over the
            # new one from the ledger; reservations still in flight carry over
            fresh.reserved_tokens, fresh.reserved_cost = old.reserved_tokens, old.reserved_cost
            self._books[key_id] = fresh
        return self._books.setdefault(key_id, fresh)

    def _load(self, key_id: str, budget: BudgetInfo) -> _Books:
        """What the ledger says this key already spent (in its window, if rolling)."""
        books = _Books(
            rolling=budget.window == "rolling" and bool(budget.window_seconds),
            window=_window(budget),
        )
        tokens = SpendRecord.prompt_tokens + SpendRecord.completion_tokens
        with self.sessions() as session:
            if budget.window == "rolling" and budget.window_seconds:
                since = datetime.now(UTC) - timedelta(seconds=budget.window_seconds)
                rows = session.execute(
                    select(SpendRecord.ts, tokens, SpendRecord.cost_usd)
                    .where(SpendRecord.key_id == key_id, SpendRecord.ts >= since)
                    .order_by(SpendRecord.ts)
                ).all()
                for ts, n, cost in rows:
                    ts = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
                    books.events.append((ts.timestamp(), int(n), float(cost)))
                    books.spent_tokens += int(n)
                    books.spent_cost += float(cost)
            else:
                n, cost = session.execute(
                    select(
                        func.coalesce(func.sum(tokens), 0),
                        func.coalesce(func.sum(SpendRecord.cost_usd), 0.0),
                    ).where(SpendRecord.key_id == key_id)
                ).one()
                books.spent_tokens, books.spent_cost = int(n), float(cost)
        return books


def _window(budget: BudgetInfo) -> tuple[str, int | None]:
    return budget.window, budget.window_seconds
