"""A fault at each await of an exchange — an error, or the client leaving (the task
cancelled) — never leaks its budget reservation, its routing slot (the router's in_flight,
which keeps a model from being evicted) or its ledger row (when its model ran). Real gateway objects on a real
SQLite file, the bench's fake node as the node."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from helexa.db.models import Reservation, SpendRecord
from helexa.gateway.auth import Principal
from helexa.gateway.request_log import RequestRecord
from helexa.gateway.service import Gateway
from tests.gateway.test_exchange import (  # noqa: F401
    CHAT,
    FAKE_USAGE,
    chat,
    fake_node,
    gateway,
    running,
)


class Injected(Exception):
    """The fault a test puts at one await."""


# Each await of an exchange's life, in order: where a fault is put.
AWAITS = (
    "routes",  # routing (a cold load may wait here)
    "reserve",  # the budget's reservation, while the database writes it
    "upstream",  # the request to the node
    "never_read",  # the handler fails between open and reading the answer
    "body",  # reading the answer (a stream's first chunk, or a whole body)
    "usage",  # asking the node what a cut exchange used
    "books",  # the ledger row's write (the database refuses the batch once)
)


def _raise(fault: str) -> None:
    if fault == "cancel":
        raise asyncio.CancelledError()
    raise Injected("injected")


def _inject(gw: Gateway, where: str, fault: str) -> None:
    up = gw.exchanges.upstream
    if where == "routes":
        routes = gw.router.routes

        async def faulty_routes(model: str) -> Any:
            await routes(model)
            _raise(fault)

        gw.router.routes = faulty_routes  # type: ignore[method-assign]
    elif where == "reserve":
        write = gw.ledger.write

        async def faulty_write(run: Any, **kw: Any) -> Any:
            if not kw.get("lock"):  # the lease's heartbeat: untouched
                return await write(run, **kw)
            inner = asyncio.ensure_future(write(run, **kw))
            await asyncio.sleep(0)  # queued for the writer: the caller goes while it waits
            assert not inner.done()
            inner.cancel()
            await asyncio.gather(inner, return_exceptions=True)
            _raise(fault)

        gw.ledger.write = faulty_write  # type: ignore[method-assign]
    elif where == "upstream":
        open_ = up.open

        async def faulty_open(*a: Any, **kw: Any) -> Any:
            _, resp = await open_(*a, **kw)  # the node has the request
            resp.close()
            _raise(fault)

        up.open = faulty_open  # type: ignore[method-assign]
    elif where in ("body", "usage"):
        open_ = up.open

        async def open_then_break(*a: Any, **kw: Any) -> Any:
            route, resp = await open_(*a, **kw)

            async def read() -> bytes:
                _raise(fault)
                return b""

            async def iter_any() -> Any:
                _raise(fault)
                yield b""

            resp.read = read
            resp.content.iter_any = iter_any
            return route, resp

        up.open = open_then_break  # type: ignore[method-assign]
        if where == "usage":
            usage = up.exchange_usage

            async def faulty_usage(*a: Any) -> Any:
                await usage(*a)
                _raise(fault)

            up.exchange_usage = faulty_usage  # type: ignore[method-assign]
    elif where == "books":
        write, failed = gw.ledger._write, []

        def faulty_write(batch: Any) -> Any:
            if any(op.keep for op in batch):  # a settlement
                if fault == "error" and not failed:  # the database refuses it once
                    failed.append(1)
                    raise OperationalError("INSERT", {}, Exception("database is locked"))
                if fault == "cancel":  # slow: the client leaves while its row is written
                    time.sleep(0.3)
            return write(batch)

        gw.ledger._write = faulty_write  # type: ignore[method-assign]


async def _handler(gw: Gateway, key: Any, stream: bool, where: str, record: RequestRecord) -> None:
    """What the web layer does for one request."""
    body, raw = chat(max_tokens=16, stream=stream)
    reply = await gw.exchanges.open(Principal(key), CHAT, body, raw, {}, record)
    if where == "never_read":
        raise Injected("the handler failed before reading")
    if reply.is_stream:
        relay = gw.exchanges.relay(reply)
        try:
            async for _ in relay:
                pass
        finally:
            await relay.aclose()
    else:
        await gw.exchanges.read(reply)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fault", ["error", "cancel"])
@pytest.mark.parametrize("where", AWAITS)
def test_a_fault_at_any_await_releases_the_reservation_the_slot_and_books_the_row(
    gateway,  # noqa: F811  (the fixture imported above)
    where,
    fault,
    stream,
):
    key, _ = gateway.keys.create("acme", cap_tokens=100_000)
    seen: dict[str, Any] = {}

    async def work(gw: Gateway) -> None:
        _inject(gw, where, fault)
        record = RequestRecord("r")
        task = asyncio.create_task(_handler(gw, key, stream, where, record))
        if where == "books" and fault == "cancel":
            while not gw.ledger.backlog and not task.done():
                await asyncio.sleep(0.01)
            task.cancel()  # the client leaves while the row is being made durable
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        record.end()  # the request is over (GatewayASGI's finally)
        await gw.exchanges.drain()
        for _ in range(100):  # the books' writer retries a refused batch
            if not gw.ledger.backlog:
                break
            await asyncio.sleep(0.05)
        seen["outcome"] = outcome
        seen["outstanding"] = gw.budgets.outstanding()
        seen["in_flight"] = sum(gw.router.in_flight.values())
        seen["record"] = record.open_parts, record.written

    running(gateway, work)
    assert seen["outstanding"] == (0, 0.0)
    assert seen["in_flight"] == 0
    assert seen["record"] == (0, True)  # the log line was written, once
    with gateway.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Reservation)) == 0
        rows = s.scalars(select(SpendRecord)).all()
    # only an exchange whose node's usage reached the gateway has a row: the fake node
    # cannot say what a cut exchange used, so the others are books of nothing, and none is
    # written (a node that can say is test_money's)
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows] == (
        [FAKE_USAGE] if where == "books" else []
    )
    if where not in ("routes", "books"):
        assert seen["outcome"] is not None  # the fault reached the handler
