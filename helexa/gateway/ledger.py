"""The spend ledger: one row per proxied request, written off the request path in batches
and never lost — `close()` flushes whatever is pending at shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from helexa.db.models import SpendRecord

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.5


class Ledger:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self._pending: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def record(self, **row: Any) -> None:
        """Queue one row (SpendRecord columns); cheap, on the event loop."""
        self._pending.append(row)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.flush()

    async def flush(self) -> int:
        async with self._lock:  # one writer at a time keeps rows in order
            rows, self._pending = self._pending, []
            if not rows:
                return 0
            try:
                await asyncio.to_thread(self._write, rows)
            except Exception:
                log.exception("writing %d ledger rows failed; they will be retried", len(rows))
                self._pending[:0] = rows
                return 0
            return len(rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        with self.sessions() as session, session.begin():
            session.add_all(SpendRecord(**row) for row in rows)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for _ in range(3):
            await self.flush()
            if not self._pending:
                return
        log.error("%d ledger rows could not be written at shutdown", len(self._pending))
