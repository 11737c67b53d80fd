"""How long the spend ledger keeps its rows (`[gateway] ledger_retention_days`).

Each gateway prunes the ledger itself: once at start, then every `PRUNE_INTERVAL_S`. Rows
go in batches of `PRUNE_BATCH` through the books' writer, one short transaction each, so a
prune never holds a long lock nor waits behind another process's; on PostgreSQL each
batch takes only rows no other gateway is deleting (`FOR UPDATE SKIP LOCKED`), so replicas
sharing one database prune side by side.

Budgets lose nothing: a balance reads its key's lifetime total (`key_spend`), never the
ledger, and a rolling window reads the ledger rows inside it, so a key whose rolling
window is longer than the retention keeps its rows for that window.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, delete, select

from helexa.db.models import Budget, SpendRecord
from helexa.gateway.ledger import DatabaseUnavailable, Ledger

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 3600.0
PRUNE_BATCH = 1000
PRUNE_TIMEOUT_S = 30.0  # one batch's wait for the writer
_PAUSE_S = 0.05  # between batches: the settlements queued meanwhile go first


def prune_batch(
    conn: Connection, now: datetime, keep_for: timedelta, limit: int = PRUNE_BATCH
) -> int:
    """Delete up to `limit` ledger rows older than `now - keep_for` that no rolling budget
    still reads; the number deleted."""
    cutoff = now - keep_for
    # keys whose rolling window reaches past the cutoff keep their rows for that window
    longer: dict[int, list[str]] = defaultdict(list)
    for key_id, seconds in conn.execute(
        select(Budget.key_id, Budget.window_seconds).where(
            Budget.window == "rolling", Budget.window_seconds > keep_for.total_seconds()
        )
    ):
        longer[int(seconds)].append(key_id)
    held = [k for keys in longer.values() for k in keys]
    wheres = [SpendRecord.ts < cutoff]
    if held:
        wheres[0] &= SpendRecord.key_id.is_(None) | SpendRecord.key_id.not_in(held)
    wheres += [
        (SpendRecord.ts < now - timedelta(seconds=seconds)) & SpendRecord.key_id.in_(keys)
        for seconds, keys in sorted(longer.items())
    ]
    deleted = 0
    for where in wheres:
        batch = (
            select(SpendRecord.id)
            .where(where)
            .order_by(SpendRecord.id)
            .limit(limit - deleted)
            .with_for_update(skip_locked=True)
        )
        ledger = SpendRecord.__table__
        done = conn.execute(delete(ledger).where(ledger.c.id.in_(batch.scalar_subquery())))
        deleted += done.rowcount
        if deleted >= limit:
            break
    return deleted


class Retention:
    """The gateway's pruning of its ledger: `start()`ed on the running loop, `stop()`ped at
    shutdown. `days` 0 keeps every row."""

    def __init__(
        self,
        ledger: Ledger,
        days: int,
        *,
        interval_s: float = PRUNE_INTERVAL_S,
        batch: int = PRUNE_BATCH,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.ledger = ledger
        self.keep_for = timedelta(days=days)
        self.interval_s = interval_s
        self.batch = batch
        self.clock = clock
        self.pruned = 0  # rows this gateway deleted
        self._task: asyncio.Task[None] | None = None

    async def prune(self) -> int:
        """Delete every ledger row past the retention, batch by batch; the number deleted."""
        total = 0
        now = self.clock()
        while True:
            n = await self.ledger.write(
                lambda conn: prune_batch(conn, now, self.keep_for, self.batch),
                timeout=PRUNE_TIMEOUT_S,
            )
            total += n
            if n < self.batch:
                break
            await asyncio.sleep(_PAUSE_S)
        self.pruned += total
        if total:
            log.info("pruned %d ledger rows older than %s", total, self.keep_for)
        return total

    def start(self) -> None:
        if self.keep_for:
            self._task = asyncio.create_task(self._run(), name="ledger-retention")

    async def _run(self) -> None:
        while True:
            try:
                await self.prune()
            except DatabaseUnavailable as e:
                log.warning("could not prune the ledger: %s; trying again later", e)
            except Exception:
                log.exception("pruning the ledger failed")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
