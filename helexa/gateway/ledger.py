"""The gateway's books in the database, written by one writer (docs/gateway.md § Budgets).

Every write — a reservation, a settlement with its ledger row, a lease's heartbeat — is an
op: a function of a SQLAlchemy connection, queued here and run by one writer thread in
batches. Each batch is one transaction (on SQLite `BEGIN IMMEDIATE`, so a reservation's
read, check and write are one step against every other process on the file; on
PostgreSQL the reservation locks its key's row), and each op runs in its own SAVEPOINT:
an op the database refuses is rolled back alone, logged and dropped, and never blocks the
rows behind it. A caller's `await` returns once its batch has committed: a ledger row is
durable when `book()` returns.

An op someone waits for (`write`: a reservation, a heartbeat) is written at once, with
whatever is queued. Ops nobody waits for (settlements, queued as requests end) linger up
to `LINGER_S` first, so that every request finishing in that instant shares one
transaction: the writer's thread, which competes with the event loop for the GIL, then
costs a fraction of a millisecond per batch instead of per request.

When the database is down or locked, a batch fails whole: the ops that must not be lost
(settlements, ledger rows) stay queued and are retried with backoff; the others (a
reservation, a heartbeat) fail, and the caller answers 503. The queue of kept ops is the
backlog; `full` tells the exchange to refuse new work before it grows past its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, event, text, update
from sqlalchemy.exc import DBAPIError, OperationalError

from helexa.db.models import Reservation, SpendRecord
from helexa.db.session import make_engine

log = logging.getLogger(__name__)
_LEDGER = SpendRecord.__table__
_RESERVATIONS = Reservation.__table__

MAX_BATCH = 256
# how long a batch of ops nobody waits for gathers company before it is written (an op
# someone waits for, a full batch or shutdown writes at once)
LINGER_S = 0.05
BACKLOG_MAX = 10_000  # kept ops waiting for the database before new requests get 503
RETRY_MIN_S, RETRY_MAX_S = 0.05, 2.0
SQLITE_LOCK_WAIT_MS = 500  # the writer's wait for another process's lock, per try


class Deferred:
    """An op whose work is decided as its batch is taken, on the event loop: `decide()`
    returns the op to run then, or None to drop it (a purse retired only if no request
    revived it while the op waited: purses.py)."""

    __slots__ = ("decide",)

    def __init__(self, decide: Callable[[], Callable[[Connection], Any] | None]) -> None:
        self.decide = decide


class _OpFailed(Exception):
    """An op of a batch run without savepoints failed: run the batch again with them."""


class DatabaseUnavailable(Exception):
    """The database did not take a write in time (down, locked, or refusing connections)."""


@dataclass(slots=True, eq=False)
class Op:
    run: Callable[[Connection], Any] | Deferred
    future: asyncio.Future[Any]
    keep: bool  # retried until written (a settlement, a ledger row); else failed at once
    lock: str = ""  # batches run ops in this order (stable), so replicas lock rows alike
    # called with the op's result when it committed after its caller stopped waiting
    # (a reservation nobody will use): undoes it
    abandoned: Callable[[Any], None] | None = None
    awaited: bool = False  # its caller waits for it: its batch does not linger
    quiet: bool = False  # housekeeping (a purse's retirement): kept, not counted as backlog
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def counted(self) -> bool:
        return self.keep and not self.quiet


@dataclass(slots=True)
class WriterState:
    """What /health and the metrics show about the writer."""

    database_ok: bool = True
    last_error: str | None = None
    failing_since: float | None = None
    written: int = 0
    dropped: int = 0  # ops the database refused, logged and dropped
    batches: int = 0


@dataclass(slots=True)
class _Queue:
    ops: deque[Op] = field(default_factory=deque)
    kept: int = 0  # of them, ops with keep=True
    awaited: int = 0  # of them, ops their caller waits for (`write`)


class Ledger:
    """The single writer of the gateway's books."""

    def __init__(self, engine: Engine, *, backlog_max: int = BACKLOG_MAX) -> None:
        self.engine = engine
        self.backlog_max = backlog_max
        self.state = WriterState()
        self._queue = _Queue()
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()  # an awaited op is queued, or the writer is closing
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        # one thread of its own: batches never wait behind other work in the default pool
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ledger")

    @classmethod
    def over(cls, shared: Engine) -> Ledger:
        """The writer for the database `shared` opens, with its own engine: on a SQLite
        file, connections that open their transactions with BEGIN IMMEDIATE and wait only
        briefly for another process's lock (the writer retries; callers time out on their
        own clock). An in-memory SQLite database has one connection: the writer shares it."""
        if shared.dialect.name != "sqlite":
            return cls(shared)
        database = shared.url.database or ""
        if database in ("", ":memory:") or shared.url.query.get("mode") == "memory":
            return cls(shared)
        engine = make_engine(shared.url.render_as_string(hide_password=False))

        @event.listens_for(engine, "connect")
        def _autocommit_driver(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            # SQLAlchemy emits BEGIN itself (below), so SAVEPOINTs work as documented
            dbapi_connection.isolation_level = None
            dbapi_connection.execute(f"PRAGMA busy_timeout={SQLITE_LOCK_WAIT_MS}")

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn) -> None:  # type: ignore[no-untyped-def]
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return cls(engine)

    # -- the queue ---------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """Writes that must not be lost and that the database has not taken: every one while
        it is failing; else those still queued past two gatherings (a settlement lingering
        for its batch's company, by design, is not behind)."""
        if not self.state.database_ok:
            return self._queue.kept
        due = time.monotonic() - 2 * LINGER_S
        return sum(1 for op in self._queue.ops if op.counted and op.queued_at < due)

    @property
    def full(self) -> bool:
        return self._queue.kept >= self.backlog_max

    def submit(
        self,
        run: Callable[[Connection], Any] | Deferred,
        *,
        keep: bool,
        lock: str = "",
        abandoned: Callable[[Any], None] | None = None,
        awaited: bool = False,
        quiet: bool = False,
    ) -> asyncio.Future[Any]:
        """Queue one op; the future is answered once its batch committed (or failed).
        `awaited`: its caller waits for it, so its batch is written without lingering.
        `quiet`: kept like a settlement but not counted in the backlog (housekeeping)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue = self._queue
        op = Op(run, future, keep, lock, abandoned, awaited, quiet)
        queue.ops.append(op)
        queue.kept += op.counted
        queue.awaited += awaited
        self._wake.set()
        if awaited or len(queue.ops) >= MAX_BATCH:
            self._hurry.set()
        return future

    async def write(
        self,
        run: Callable[[Connection], Any],
        *,
        timeout: float,
        lock: str = "",
        abandoned: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run an op that may fail (not kept) and wait for it, at most `timeout` seconds;
        DatabaseUnavailable when the database did not take it in time. `abandoned` undoes
        what the op wrote if its caller has gone by the time it commits."""
        future = self.submit(run, keep=False, lock=lock, abandoned=abandoned, awaited=True)
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            # that lands as the future completes, leaving the caller running on
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            future.cancel()  # the writer skips it, or undoes it if it already ran
            raise DatabaseUnavailable(self.state.last_error or "timed out") from None
        except BaseException:  # the caller is gone (cancelled)
            if not future.done():
                future.cancel()  # as for a timeout
            elif abandoned is not None and not future.cancelled() and not future.exception():
                abandoned(future.result())  # written just as the caller went: undone
            raise

    def record(self, **row: Any) -> asyncio.Future[Any]:
        """Queue one ledger row (SpendRecord columns) with nothing else to settle."""
        return self.submit(BookRow(row), keep=True, lock=row.get("key_id") or "")

    # -- the writer --------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger")

    async def _run(self) -> None:
        delay = RETRY_MIN_S
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue.ops:
                self._wake.clear()
                if self._closing:
                    return
                await self._wake.wait()
                continue
            if not self._hurry.is_set():  # nobody waits: let the instant's other ops join
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LINGER_S):
                        await self._hurry.wait()
            batch = self._take()
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._pool, self._write, batch)
            except Exception as e:
                self._failed(batch, e)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            delay = RETRY_MIN_S
            self._done(batch, results)

    def _take(self) -> list[Op]:
        batch: list[Op] = []
        ops = self._queue.ops
        while ops and len(batch) < MAX_BATCH:
            op = ops.popleft()
            self._queue.awaited -= op.awaited
            if op.future.done() and not op.keep:  # its caller gave up before it ran
                continue
            if isinstance(op.run, Deferred):
                run = op.run.decide()
                if run is None:  # nothing to do after all
                    self._queue.kept -= op.counted
                    if not op.future.done():
                        op.future.set_result(None)
                    continue
                op.run = run
            batch.append(op)
        if not self._closing and not self._queue.awaited and len(ops) < MAX_BATCH:
            self._hurry.clear()
        batch.sort(key=lambda op: op.lock)  # stable: one key's ops keep their order
        return batch

    def _write(self, batch: list[Op]) -> list[tuple[bool, Any]]:
        """One transaction for the batch (in the writer thread). Plain Core on one
        connection: the ORM's session costs more than SQLite's own work on rows this small.
        Ops run without savepoints first; only when one fails is the batch run again, each
        op in a SAVEPOINT, so the one the database refuses is dropped alone."""
        try:
            return self._write_batch(batch, savepoints=False)
        except _OpFailed:
            return self._write_batch(batch, savepoints=True)

    def _write_batch(self, batch: list[Op], *, savepoints: bool) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any]] = []
        alone = len(batch) == 1  # its failure is the transaction's: no savepoint needed
        # without savepoints, the batch's plain rows go in first, in one statement: they
        # only add to the books, so what the other ops read is never less than before
        rows = [] if savepoints else [op.run for op in batch if isinstance(op.run, BookRow)]
        with self.engine.connect() as conn, conn.begin():
            found: set[str] = set()
            if len(rows) > 1:
                try:
                    found = take_reserved(conn, [r.take for r in rows if r.take is not None])
                    book_rows(conn, [r.row for r in rows if r.take is None or r.take[0] in found])
                except Exception as e:
                    if _database_down(e):
                        raise  # the batch fails and is retried
                    raise _OpFailed from e  # rolled back; each op again in a savepoint
            else:
                rows = []
            for op in batch:
                if rows and isinstance(op.run, BookRow):  # written above
                    take = op.run.take
                    results.append((True, take is None or take[0] in found))
                    continue
                try:
                    if savepoints and not alone:
                        with conn.begin_nested():
                            results.append((True, op.run(conn)))
                    else:
                        results.append((True, op.run(conn)))
                except Exception as e:
                    if _database_down(e):
                        raise  # the database, not this op: the batch fails and is retried
                    if not (savepoints or alone):
                        raise _OpFailed from e  # rolled back; run again with savepoints
                    results.append((False, e))  # the op's own fault: dropped alone
        return results

    def _failed(self, batch: list[Op], error: Exception) -> None:
        state = self.state
        message = _describe(error)
        if state.database_ok:
            log.error("the database refused the books' writes: %s; retrying", message)
            state.failing_since = time.monotonic()
        state.database_ok, state.last_error = False, message
        kept = [op for op in batch if op.keep]
        for op in batch:
            if not op.keep and not op.future.done():
                op.future.set_exception(DatabaseUnavailable(message))
        self._queue.ops.extendleft(reversed(kept))  # first in line again, in order

    def _done(self, batch: list[Op], results: list[tuple[bool, Any]]) -> None:
        state = self.state
        if not state.database_ok:
            log.warning("the database takes the books' writes again")
        state.database_ok, state.failing_since = True, None
        state.batches += 1
        for op, (ok, value) in zip(batch, results, strict=True):
            self._queue.kept -= op.counted
            if not ok:
                state.dropped += 1
                log.error("the database refused a write to the books; it is dropped: %s", value)
                if not op.future.done():
                    op.future.set_exception(value)
                continue
            state.written += 1
            if op.future.done():
                if op.abandoned is not None:
                    op.abandoned(value)
            else:
                op.future.set_result(value)

    async def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer."""
        self._closing = True
        self._wake.set()
        self._hurry.set()
        if self._task is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._task)
        except TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=False)
        if self._queue.kept:
            log.error("%d writes to the books could not be made at shutdown", self._queue.kept)


class BookRow:
    """The op that books one ledger row: an unbudgeted request's, or (`take`: a reservation
    row's id, tokens, cost) one whose use is taken out of the reservation row it drew on (a
    purse's, purses.py). A batch writes all of its own together: one statement for the rows,
    one update per reservation row drawn on. Its result: whether it was booked (False: the
    reservation row was booked whole already, when its gateway's lease ran out)."""

    __slots__ = ("row", "take")

    def __init__(self, row: dict[str, Any], take: tuple[str, int, float] | None = None) -> None:
        self.row = row
        self.take = take

    def __call__(self, conn: Connection) -> bool:
        if self.take is not None and not take_reserved(conn, [self.take]):
            return False
        book_row(conn, self.row)
        return True


_TAKE = (
    update(_RESERVATIONS)
    .where(_RESERVATIONS.c.id == bindparam("rid"))
    .values(
        output_tokens=_RESERVATIONS.c.output_tokens - bindparam("tokens"),
        cost_usd=_RESERVATIONS.c.cost_usd - bindparam("cost"),
    )
)


def take_reserved(conn: Connection, takes: list[tuple[str, int, float]]) -> set[str]:
    """Take what requests used out of the reservation rows they drew on (summed per row);
    the ids of the rows that were there. A missing row was booked whole when its gateway's
    lease ran out: what was drawn on it is not booked again."""
    per_row: dict[str, list[float]] = {}
    for rid, tokens, cost in takes:
        total = per_row.setdefault(rid, [0, 0.0])
        total[0] += tokens
        total[1] += cost
    found = set()
    for rid, (tokens, cost) in per_row.items():
        if conn.execute(_TAKE, {"rid": rid, "tokens": int(tokens), "cost": cost}).rowcount:
            found.add(rid)
        else:
            log.warning(
                "reservation %s was booked whole when its gateway's lease ran out; the %s "
                "tokens its requests used are not booked again",
                rid,
                int(tokens),
            )
    return found


def book_rows(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert ledger rows (one statement per set of columns), and add their spend to
    their keys' lifetime totals (one upsert per key)."""
    by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    spend: dict[str, list[float]] = {}
    for row in rows:
        by_columns.setdefault(tuple(sorted(row)), []).append(row)
        key_id = row.get("key_id")
        if key_id:
            total = spend.setdefault(key_id, [0, 0.0])
            total[0] += int(row.get("prompt_tokens") or 0) + int(row.get("completion_tokens") or 0)
            total[1] += float(row.get("cost_usd") or 0.0)
    for same in by_columns.values():
        conn.execute(_LEDGER.insert(), same)
    for key_id, (tokens, cost) in spend.items():
        if tokens or cost:
            _add_key_spend(conn, key_id, int(tokens), cost)


def book_row(conn: Connection, row: dict[str, Any]) -> None:
    """Insert one ledger row, and add its spend to its key's lifetime total."""
    book_rows(conn, [row])


# the same statement on SQLite (3.24+) and PostgreSQL, built once
_ADD_KEY_SPEND = text(
    "INSERT INTO key_spend (key_id, tokens, cost_usd) VALUES (:key_id, :tokens, :cost) "
    "ON CONFLICT (key_id) DO UPDATE SET tokens = key_spend.tokens + excluded.tokens, "
    "cost_usd = key_spend.cost_usd + excluded.cost_usd"
)


def _add_key_spend(conn: Connection, key_id: str, tokens: int, cost: float) -> None:
    conn.execute(_ADD_KEY_SPEND, {"key_id": key_id, "tokens": tokens, "cost": cost})


def _database_down(e: Exception) -> bool:
    """Whether an op's error is the database's (the batch is retried), not the op's."""
    return isinstance(e, OperationalError) or (
        isinstance(e, DBAPIError) and e.connection_invalidated
    )


def _describe(error: BaseException) -> str:
    orig = getattr(error, "orig", None)
    return f"{type(orig or error).__name__}: {orig or error}".splitlines()[0][:300]
