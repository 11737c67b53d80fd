"""Books that grow only with real work: a request on which no model ran — refused by the
gateway at its door, or by the node before its engine ran — writes no ledger row, whoever
sends it, while every served request is still booked exactly. A real gateway process in
front of a real node process."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
from sqlalchemy import func, select

from helexa.db.models import Reservation, SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import GatewayProcess, start_gateway
from tests.web.node_proc import NodeProcess, start_node

MALFORMED = 10_000
SERVED = 60
CONCURRENCY = 16
PRICE = {"input": 1.0, "output": 2.0}


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dirs) -> Iterator[NodeProcess]:
    proc = start_node(
        tmp_path_factory.mktemp("unbooked-node"),
        [str(model_dirs["scripted"]), str(model_dirs["tiny"])],
    )
    yield proc
    proc.stop()


@pytest.fixture
def gw(tmp_path, node, model_dirs) -> Iterator[GatewayProcess]:
    models = [{"id": str(model_dirs[m]), "cost": PRICE} for m in ("scripted", "tiny")]
    gw = start_gateway(tmp_path, {"n": node}, models=models)
    yield gw
    gw.stop()


def _ledger(url: str) -> list[SpendRecord]:
    with session_factory(make_engine(url))() as s:
        return list(s.scalars(select(SpendRecord).order_by(SpendRecord.id)))


def _malformed(scripted: str, tiny: str) -> list[tuple[str, bytes, int, str]]:
    """(path, body, the status expected, who refuses it) for each kind of bad request."""

    def chat(model: str, content: str = "hi", **extra: object) -> bytes:
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return json.dumps(body).encode()

    def js(**body: object) -> bytes:
        return json.dumps(body).encode()

    return [
        # the node refuses these before its engine runs
        ("/chat/completions", js(model=scripted, messages="hello"), 400, "node"),
        ("/chat/completions", chat(scripted, temperature="hot"), 400, "node"),
        ("/chat/completions", js(model=scripted, messages=[{"role": 7}]), 400, "node"),
        ("/completions", js(model=scripted, prompt=7), 400, "node"),
        ("/responses", js(model=scripted, input=5), 400, "node"),
        ("/responses", js(model=scripted, input="hi", previous_response_id="r"), 400, "node"),
        # under the edge's estimate (~4 characters a token), past the node's 256 tokens
        ("/chat/completions", chat(tiny, "a " * 300), 400, "node"),
        # the gateway refuses these itself
        ("/chat/completions", b"{not json", 400, "gateway"),
        ("/chat/completions", js(messages=[]), 400, "gateway"),
        ("/chat/completions", chat("no/such-model"), 404, "gateway"),
        ("/chat/completions", chat(tiny, "word " * 2000), 400, "gateway"),  # past the edge
    ]


async def _send_all(
    v1: str, work: list[tuple[str, bytes, dict[str, str]]]
) -> list[tuple[int, dict]]:
    """Every request, CONCURRENCY at a time over keep-alive connections; (status, body)."""
    results: list[tuple[int, dict]] = [(0, {})] * len(work)
    queue = iter(enumerate(work))
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for i, (path, body, headers) in queue:
                async with session.post(
                    v1 + path, data=body, headers={"content-type": "application/json", **headers}
                ) as r:
                    text = await r.text()
                    results[i] = (r.status, _usage_of(text, path))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return results


def _usage_of(text: str, path: str) -> dict:
    """The usage a served answer (a body, or a stream's last usage) told its client."""
    usage: dict = {}
    for line in text.splitlines() if "data: " in text else [text]:
        line = line.removeprefix("data: ")
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            usage = obj.get("usage") or (obj.get("response") or {}).get("usage") or usage
    return usage


def _metric_sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _reservations(sessions) -> int:
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(Reservation))


def test_ten_thousand_malformed_requests_leave_the_ledger_as_it_was(gw, model_dirs):
    scripted, tiny = str(model_dirs["scripted"]), str(model_dirs["tiny"])
    info, secret = KeyStore(session_factory(make_engine(gw.database_url))).create(
        "acme", cap_tokens=1_000_000
    )
    keyed = {"Authorization": f"Bearer {secret}"}
    kinds = _malformed(scripted, tiny)
    rng = random.Random(34)
    work: list[tuple[str, bytes, dict[str, str]]] = []
    expected: list[tuple[int, str]] = []
    for i in range(MALFORMED):
        path, body, status, who = kinds[i % len(kinds)]
        # a tenth from the budgeted key: its reservations must all be released
        work.append((path, body, keyed if rng.random() < 0.1 else {}))
        expected.append((status, who))
    # served requests among them, streamed and not, anonymous and keyed
    served_at = sorted(rng.sample(range(len(work)), SERVED))
    for n, at in enumerate(served_at):
        body = {"model": scripted, "messages": [{"role": "user", "content": f"hi {n}"}]}
        if n % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        work.insert(at, ("/chat/completions", json.dumps(body).encode(), keyed if n % 3 else {}))
        expected.insert(at, (200, "served"))

    before = len(_ledger(gw.database_url))
    t0 = time.monotonic()
    results = asyncio.run(_send_all(gw.v1, work))
    took = time.monotonic() - t0

    got = Counter((status, who) for (status, _), (_, who) in zip(results, expected, strict=True))
    assert [s for s, _ in results] == [s for s, _ in expected], got
    served = [u for (_, u), (_, who) in zip(results, expected, strict=True) if who == "served"]
    assert len(served) == SERVED and all(u.get("total_tokens") for u in served)
    deadline = time.monotonic() + 15  # rows are durable before an answer ends; be generous
    while len(rows := _ledger(gw.database_url)) < before + SERVED and time.monotonic() < deadline:
        time.sleep(0.1)
    new = rows[before:]
    # the ledger moved by the served requests alone, each booked as its client was told
    assert len(rows) == before + SERVED, Counter(r.status for r in new)
    assert {r.status for r in new} == {200}
    assert sorted((r.prompt_tokens, r.completion_tokens) for r in new) == sorted(
        (u["prompt_tokens"], u["completion_tokens"]) for u in served
    )
    assert sum(r.key_id == info.id for r in new) == sum(1 for n in range(SERVED) if n % 3)
    for r in new:
        assert r.cost_usd == pytest.approx(
            (r.prompt_tokens * PRICE["input"] + r.completion_tokens * PRICE["output"]) / 1e6
        )
    # every reservation of the key's refused requests was released: at once in the
    # gateway's own count, and in the database within the books' writer's linger (a
    # release nobody awaits is batched with the ops ending with it)
    assert gw.get("/health").json()["budget_reserved_tokens"] == 0
    reservations = session_factory(make_engine(gw.database_url))
    deadline = time.monotonic() + 5
    while _reservations(reservations) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _reservations(reservations) == 0
    # what the nodes refused is counted on the metrics port instead
    node_refused = sum(1 for status, who in expected if who == "node")
    metrics = httpx.get(gw.metrics_url + "/metrics").text
    assert _metric_sum(metrics, "helexa_requests_unbooked_total") == node_refused
    print(
        f"{len(work)} requests ({MALFORMED} malformed: {node_refused} refused by the node, "
        f"{MALFORMED - node_refused} by the gateway; {SERVED} served) in {took:.1f} s; "
        f"ledger rows {before} -> {len(rows)}"
    )
