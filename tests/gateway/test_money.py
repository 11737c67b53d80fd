"""Every token billed, and caps that hold across crashes and across gateway replicas: real
gateway processes in front of a real node process, on SQLite and on a real PostgreSQL.

The node's own counters (`helexa_prompt_tokens_total` + `helexa_generation_tokens_total`)
are the truth of what it processed: each test's node serves nobody else while it counts.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from helexa.db.models import Reservation, SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.budgets import LEASE_EXPIRED
from helexa.gateway.keys import KeyStore
from helexa.gateway.spend_query import SpendFilter, totals_by
from tests.gateway.gateway_proc import GatewayProcess, start_gateway
from tests.model_fixtures import QWEN3, REASONING, SCRIPT
from tests.web.node_proc import NodeProcess, scripted_model, start_node

THINKING = "<think>\n" + " ".join([REASONING] * 30) + "\n</think>\n\nFour."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dirs) -> dict[str, str]:
    root = tmp_path_factory.mktemp("money-models")
    return {
        "tiny": str(model_dirs["tiny"]),
        "long": str(model_dirs["long"]),
        "plain": str(scripted_model(root, SCRIPT, "plain")),  # no tool-call markers
        "thinks": str(scripted_model(root, THINKING, "thinks", tokenizer_from=QWEN3)),
    }


@pytest.fixture(scope="module")
def node(tmp_path_factory, models) -> Iterator[NodeProcess]:
    # no per-principal cap on the node: every refusal here is the gateway's
    proc = start_node(
        tmp_path_factory.mktemp("money-node"),
        list(models.values()),
        node={"per_principal_max": 0, "max_waiting_requests": 512},
    )
    yield proc
    proc.stop()


def _gateway(tmp: Path, node: NodeProcess, models: dict[str, str], **gateway) -> GatewayProcess:
    return start_gateway(
        tmp,
        {"n": node},
        models=[{"id": m, "cost": {"input": 1.0, "output": 2.0}} for m in models.values()],
        gateway={"reservation_lease_s": 2.0, **gateway},
    )


@pytest.fixture
def gw(tmp_path, node, models) -> Iterator[GatewayProcess]:
    gw = _gateway(tmp_path, node, models)
    yield gw
    gw.stop()


def _sessions(url: str):
    return session_factory(make_engine(url))


def _node_tokens(node: NodeProcess) -> int:
    """Prompt plus generated tokens the node has processed, over every model."""
    total = 0.0
    for line in node.get("/metrics").text.splitlines():
        if line.startswith(("helexa_prompt_tokens_total{", "helexa_generation_tokens_total{")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _node_idle(node: NodeProcess, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(m["in_flight"] == 0 for m in node.get("/health").json()["models"]):
            return
        time.sleep(0.05)
    raise AssertionError("the node still runs requests")


def _rows(url: str, key_id: str, *, at_least: int = 1, timeout_s: float = 15) -> list[SpendRecord]:
    sessions = _sessions(url)
    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as s:
            rows = list(
                s.scalars(
                    select(SpendRecord).where(SpendRecord.key_id == key_id).order_by(SpendRecord.id)
                )
            )
        if len(rows) >= at_least or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _billed(rows: list[SpendRecord]) -> int:
    return sum(r.prompt_tokens + r.completion_tokens for r in rows)


def _key(url: str, cap: int | None = None) -> tuple[str, dict[str, str]]:
    info, secret = KeyStore(_sessions(url)).create("acme", cap_tokens=cap)
    return info.id, {"Authorization": f"Bearer {secret}"}


def _cut_after(url: str, body: dict, headers: dict[str, str], events: int) -> list[dict]:
    """Stream `body`, and leave once `events` data events carrying text have arrived."""
    seen: list[dict] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            delta = (obj.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or obj.get("delta"):
                seen.append(obj)
            if len(seen) >= events:
                break
    return seen


# -- attacks: each billed at least what the node generated --------------------------------


def test_a_tool_choice_refused_after_the_answer_is_billed_what_the_node_generated(gw, node, models):
    key_id, auth = _key(gw.database_url, cap=100_000)
    before = _node_tokens(node)
    body = {
        "model": models["plain"],
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "required",
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 422, r.text
    _node_idle(node)
    generated = _node_tokens(node) - before
    [row] = _rows(gw.database_url, key_id)
    assert row.status == 422 and row.completion_tokens > 0
    assert _billed([row]) >= generated > 0
    assert _billed([row]) == r.json()["error"]["usage"]["total_tokens"]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_cut_reasoning_stream_is_billed_at_least_what_the_node_generated(gw, node, models, api):
    key_id, auth = _key(gw.database_url, cap=100_000)
    before = _node_tokens(node)
    ask = [{"role": "user", "content": "What is two and two?"}]
    if api == "chat":
        url, body = gw.v1 + "/chat/completions", {"messages": ask}
    else:
        url, body = gw.v1 + "/responses", {"input": ask}
    seen = _cut_after(url, {"model": models["thinks"], "stream": True, **body}, auth, events=3)
    assert len(seen) == 3
    _node_idle(node)
    generated = _node_tokens(node) - before
    [row] = _rows(gw.database_url, key_id)
    assert row.status == 499  # the client closed the request
    assert _billed([row]) >= generated > 0
    assert row.completion_tokens >= len(seen)
    assert httpx.get(gw.base_url + "/health").json()["budget_reserved_tokens"] == 0


def test_n_choices_are_reserved_whole_and_billed(gw, node, models):
    cap = 300
    key_id, auth = _key(gw.database_url, cap=cap)
    before = _node_tokens(node)
    body = {
        "model": models["tiny"],
        "messages": [{"role": "user", "content": "Count."}],
        "n": 4,
        "max_tokens": 200,  # four of these do not fit: each choice gets its share
        "ignore_eos": True,
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert len(answer["choices"]) == 4
    generated = _node_tokens(node) - before
    assert generated == answer["usage"]["total_tokens"] <= cap
    per_choice = answer["usage"]["completion_tokens"] // 4
    assert 1 <= per_choice < 200 // 4 + 1
    [row] = _rows(gw.database_url, key_id)
    assert _billed([row]) == generated
    # what is left cannot hold one token for each of four choices: refused before the node
    left = cap - generated
    refused = httpx.post(
        gw.v1 + "/chat/completions", json={**body, "n": max(4, left)}, headers=auth, timeout=60
    )
    assert refused.status_code == 429, refused.text
    assert _node_tokens(node) == before + generated


# -- caps across replicas and crashes -------------------------------------------------------


def _flood(gateways: list[GatewayProcess], auth: dict, model: str, n: int) -> list[httpx.Response]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 12,
        "ignore_eos": True,
    }

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        gateways[i % len(gateways)].v1 + "/chat/completions",
                        json=body,
                        headers=auth,
                    )
                    for i in range(n)
                )
            )

    return asyncio.run(run())


def test_two_gateways_on_one_postgresql_never_pass_a_cap_together(
    tmp_path, node, models, postgres_url
):
    cap = 3000
    a = _gateway(tmp_path / "a", node, models, database_url=postgres_url)
    b = _gateway(tmp_path / "b", node, models, database_url=postgres_url)
    try:
        key_id, auth = _key(postgres_url, cap=cap)
        before = _node_tokens(node)
        results = _flood([a, b], auth, models["tiny"], 200)
        served = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code == 429]
        assert len(served) + len(refused) == 200, {r.status_code for r in results}
        assert served and refused
        assert {r.headers["x-helexa-node"] for r in served} == {"n"}
        _node_idle(node)
        processed = _node_tokens(node) - before
        billed_to_clients = sum(r.json()["usage"]["total_tokens"] for r in served)
        rows = _rows(postgres_url, key_id, at_least=len(served))
        assert len(rows) == len(served)
        assert processed == billed_to_clients == _billed(rows) <= cap
        for g in (a, b):
            assert g.get("/health").json()["budget_reserved_tokens"] == 0
        # one ledger: `helexa spend` and the console's Spend page read these same rows
        [cli] = KeyStore(_sessions(postgres_url)).spend_totals(key_id=key_id)
        with _sessions(postgres_url)() as s:
            console = totals_by(s, SpendFilter.parse({}), "key_id", top=None)
        [page] = [t for t in console if t.name == key_id]
        assert cli["prompt_tokens"] + cli["completion_tokens"] == page.tokens == _billed(rows)
        assert cli["requests"] == page.requests == len(served)
        with _sessions(postgres_url)() as s:
            assert s.scalar(select(func.count()).select_from(Reservation)) == 0
        print(f"replicas: {len(served)} served, {processed} tokens of {cap}, {len(refused)} 429")
    finally:
        a.stop()
        b.stop()


def test_a_gateway_killed_mid_flight_never_lets_a_key_pass_its_cap(tmp_path, node, models):
    cap = 1500
    a = _gateway(tmp_path / "a", node, models)
    url = a.database_url
    b = _gateway(tmp_path / "b", node, models, database_url=url)
    try:
        key_id, auth = _key(url, cap=cap)
        before = _node_tokens(node)
        body = {
            "model": models["long"],
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
        }

        async def streams() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                first_bytes = 0
                arrived = asyncio.Event()

                async def one() -> None:
                    nonlocal first_bytes
                    try:
                        async with client.stream(
                            "POST", a.v1 + "/chat/completions", json=body, headers=auth
                        ) as r:
                            async for _ in r.aiter_bytes():
                                first_bytes += 1
                                if first_bytes >= 12:
                                    arrived.set()
                    except httpx.HTTPError:
                        pass  # the gateway died under it

                tasks = [asyncio.create_task(one()) for _ in range(12)]
                await asyncio.wait_for(arrived.wait(), 60)
                a.proc.send_signal(signal.SIGKILL)  # mid-flight: reservations held, unsettled
                await asyncio.gather(*tasks)

        asyncio.run(streams())
        a.proc.wait(10)
        with _sessions(url)() as s:
            held = s.scalar(select(func.count()).select_from(Reservation))
        assert held > 0  # the dead gateway's reservations still count against the cap
        a2 = _gateway(tmp_path / "a2", node, models, database_url=url)
        try:
            flood = {**body, "stream": False, "max_tokens": 20, "model": models["tiny"]}
            statuses = []
            for _ in range(200):
                target = (a2, b)[len(statuses) % 2]
                r = httpx.post(
                    target.v1 + "/chat/completions", json=flood, headers=auth, timeout=60
                )
                statuses.append(r.status_code)
                if r.status_code == 429:
                    break
                assert r.status_code == 200, r.text
            assert statuses[-1] == 429
            _node_idle(node)
            processed = _node_tokens(node) - before
            assert processed <= cap, (processed, cap)
            # once the lease ran out, the dead gateway's reservations were booked whole
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                rows = _rows(url, key_id)
                # every held lease booked (a sweep may book them over several passes)
                if sum(r.finish_reason == LEASE_EXPIRED for r in rows) >= held:
                    break
                time.sleep(0.2)
            expired = [r for r in rows if r.finish_reason == LEASE_EXPIRED]
            assert len(expired) == held
            assert processed <= _billed(rows) <= cap
            print(f"crash: {processed} tokens processed, {_billed(rows)} billed, cap {cap}")
        finally:
            a2.stop()
    finally:
        if a.proc.poll() is None:
            a.stop()
        b.stop()


# -- the database locked or down ----------------------------------------------------------

LOCKER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


def test_a_locked_sqlite_database_gives_503_then_service_comes_back_with_nothing_lost(
    gw, node, models
):
    key_id, auth = _key(gw.database_url, cap=100_000)
    body = {
        "model": models["tiny"],
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
    }
    path = gw.database_url.removeprefix("sqlite:///")
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, path, "8"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "service_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
        # refused on the gateway's clock while the lock is still held, not once it went
        assert locker.poll() is None, f"answered only after the lock ({time.monotonic() - t0:.1f}s)"
        # an anonymous request is still served; its row waits in the backlog
        anon = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
        assert anon.status_code == 200, anon.text
        health = gw.get("/health").json()["books"]
        assert health["database"] == "unavailable" and health["backlog"] >= 1
        metrics = httpx.get(gw.metrics_url + "/metrics").text
        assert "helexa_database_up 0.0" in metrics
    finally:
        assert locker.wait(30) == 0
    deadline = time.monotonic() + 15
    while True:
        r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert gw.get("/health").json()["books"] == {
        "database": "ok",
        "backlog": 0,
        "backlog_max": 10_000,
        "dropped": 0,
        "last_error": gw.get("/health").json()["books"]["last_error"],
    }
    with _sessions(gw.database_url)() as s:
        rows = s.scalars(select(SpendRecord).order_by(SpendRecord.id)).all()
    # the anonymous answer given during the lock, then the metered one after: nothing lost
    assert [(r.key_id, r.status) for r in rows][-2:] == [(None, 200), (key_id, 200)]
    assert sum(r.status == 503 for r in rows) == 0  # a refused reservation never reached a node


# -- nodes that stop, and clients that leave ---------------------------------------------


def _sse_lines(r: httpx.Response) -> list[str]:
    return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_a_client_that_leaves_a_non_streaming_request_stops_the_nodes_work(gw, node, models):
    key_id, auth = _key(gw.database_url, cap=1_000_000)
    body = {
        "model": models["long"],
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 6000,
        "ignore_eos": True,
    }
    before = _node_tokens(node)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=1.5)
    t0 = time.monotonic()
    _node_idle(node, timeout_s=10)
    stopped_after = time.monotonic() - t0
    generated = _node_tokens(node) - before
    [row] = _rows(gw.database_url, key_id)
    assert row.status == 499
    assert 0 < row.completion_tokens < 6000
    assert _billed([row]) >= generated
    assert gw.get("/health").json()["budget_reserved_tokens"] == 0
    print(f"non-stream client left: node idle {stopped_after:.2f} s later, {generated} tokens")


def _busy(node) -> bool:
    """Whether a model on `node` still has a request in flight or queued."""
    models = node.get("/health").json()["models"]
    return any(m["in_flight"] or m["queue_depth"] for m in models)


def _polled_up_since(gw, when: float) -> bool:
    """Whether the gateway's only node is up by a poll answered after `when`."""
    (node,) = gw.get("/health").json()["nodes"]
    return node["up"] and (node["last_seen"] or 0) > when


def test_a_node_that_stops_or_dies_mid_stream_ends_the_stream_with_an_error_event(tmp_path, models):
    lone = start_node(tmp_path / "node", [models["long"]], node={"per_principal_max": 0})
    gw = _gateway(tmp_path / "gw", lone, {"long": models["long"]}, upstream_idle_timeout_s=2.0)
    try:
        key_id, auth = _key(gw.database_url, cap=1_000_000)
        body = {
            "model": models["long"],
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 6000,
            "ignore_eos": True,
            "stream": True,
        }
        for how in (signal.SIGSTOP, signal.SIGKILL):
            events: list[str] = []
            t0 = time.monotonic()
            with httpx.stream(
                "POST", gw.v1 + "/chat/completions", json=body, headers=auth, timeout=60
            ) as r:
                assert r.status_code == 200, (how.name, r.read())
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 5:
                        lone.proc.send_signal(how)  # hung (stopped) or gone
                        t0 = time.monotonic()
            ended_after = time.monotonic() - t0
            last = json.loads(events[-1][6:])
            assert last["error"]["code"] == "upstream_cut", events[-3:]
            assert "data: [DONE]" not in events
            if how == signal.SIGSTOP:
                # the idle timeout, not the client's own 60 s read timeout (a hang guard)
                assert 1.5 < ended_after < 30
                resumed = time.time()
                lone.proc.send_signal(signal.SIGCONT)
                # Up by a poll answered after the resume: one sent while the node was
                # stopped may still time out (and take it out of routing) just after it.
                deadline = time.monotonic() + 30
                while not _polled_up_since(gw, resumed) or _busy(lone):
                    assert time.monotonic() < deadline  # up, and the cut stream let go
                    time.sleep(0.1)
            assert gw.get("/health").json()["budget_reserved_tokens"] == 0
            print(f"{how.name}: stream ended with an error event {ended_after:.2f} s later")
        rows = _rows(gw.database_url, key_id, at_least=2)
        assert [r.status for r in rows] == [502, 502]
        assert all(r.completion_tokens >= 4 for r in rows)  # what arrived is billed
    finally:
        gw.stop()
        if lone.proc.poll() is None:
            lone.proc.send_signal(signal.SIGCONT)
            lone.stop()
