"""One exchange's rules without HTTP in front: the gateway built by `build_gateway` on a real
SQLite file, its exchanges opened with plain values against the bench's fake node (a real
process speaking the node's wire contract), and the books' reading of answers fed chunk by
chunk."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sqlalchemy import select

from helexa.config import load_config
from helexa.db.models import SpendRecord
from helexa.errors import HelexaError
from helexa.gateway.accounting import Accountant, Exchange, Tally, settled_counts
from helexa.gateway.auth import ANONYMOUS, Principal
from helexa.gateway.budgets import Budgets
from helexa.gateway.fleet import Fleet
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.request_log import RequestRecord
from helexa.gateway.service import Gateway, build_gateway
from helexa.protocol.wire import Price, cost_usd, sse_data, sse_event
from tests.web.node_proc import free_port

REPO = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MODEL = "fake-model"  # what bench/fake_node.py serves
IN_PRICE, OUT_PRICE = 2.0, 4.0
FAKE_USAGE = (12, 5)  # the fake node's prompt and completion tokens


@pytest.fixture(scope="module")
def fake_node(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("fake-node") / "fake.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "fake_node.py"), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the fake node did not start:\n{log.read_text()}")
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def gateway(tmp_path: Path, fake_node: str) -> Gateway:
    config = tmp_path / "helexa.toml"
    config.write_text(
        f'[gateway]\ndatabase_url = "sqlite:///{tmp_path / "helexa.db"}"\n'
        f'[[nodes]]\nname = "fake"\nendpoint = "{fake_node}"\n'
        f'[[models]]\nid = "{MODEL}"\ncost = {{ input = {IN_PRICE}, output = {OUT_PRICE} }}\n'
        f'[aliases]\nfm = "{MODEL}"\n'
    )
    return build_gateway(load_config(config, env={}))


def running(gateway: Gateway, work: Callable[[Gateway], Awaitable[Any]]) -> Any:
    """`work` on the started gateway once it has polled its node; stopped after (every
    ledger row written)."""

    async def main() -> Any:
        await gateway.start()
        try:
            for node in gateway.fleet.nodes.values():
                await gateway.poller.poll_once(node)
            return await work(gateway)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def chat(model: str = MODEL, **extra: Any) -> tuple[dict[str, Any], bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], **extra}
    return body, msgspec.json.encode(body)


def ledger(gateway: Gateway) -> list[SpendRecord]:
    with gateway.sessions() as s:
        return list(s.scalars(select(SpendRecord).order_by(SpendRecord.id)))


# -- exchanges with a node --------------------------------------------------------------


def test_a_chat_exchange_is_settled_from_the_nodes_usage_once_its_answer_is_read(gateway):
    key, _ = gateway.keys.create("acme")
    record = RequestRecord("ex-1")
    seen: dict[str, Any] = {}

    async def work(gw: Gateway) -> bytes:
        body, raw = chat()
        reply = await gw.exchanges.open(
            Principal(key), CHAT, body, raw, {"x-request-id": "ex-1"}, record
        )
        seen["in_flight"] = dict(gw.router.in_flight)
        seen["node"], seen["stream"] = reply.node, reply.is_stream
        data = await gw.exchanges.read(reply)
        seen["after"] = dict(gw.router.in_flight)
        return data

    answer = msgspec.json.decode(running(gateway, work))
    assert answer["usage"]["completion_tokens"] == FAKE_USAGE[1]
    assert seen["node"] == "fake" and seen["stream"] is False
    assert seen["in_flight"] == {("fake", MODEL): 1} and seen["after"] == {("fake", MODEL): 0}
    assert (record.prompt_tokens, record.completion_tokens) == FAKE_USAGE
    assert (record.model, record.node, record.finish_reason) == (MODEL, "fake", "stop")
    assert record.open_parts == 1  # the exchange let go; the response still holds the line
    [row] = ledger(gateway)
    assert (row.key_id, row.account_id, row.model, row.node) == (key.id, "acme", MODEL, "fake")
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (*FAKE_USAGE, 200)
    assert row.cost_usd == pytest.approx(cost_usd(*FAKE_USAGE, IN_PRICE, OUT_PRICE))
    assert row.finish_reason == "stop"


def test_a_stream_is_relayed_as_the_node_sent_it_and_booked_from_its_events(gateway):
    async def work(gw: Gateway) -> bytes:
        body, raw = chat(stream=True)
        reply = await gw.exchanges.open(ANONYMOUS, CHAT, body, raw, {})
        assert reply.is_stream and reply.media_type == "text/event-stream"
        return b"".join([chunk async for chunk in gw.exchanges.relay(reply)])

    relayed = running(gateway, work)
    assert relayed.count(b'"content":"') == 6 and relayed.endswith(b"data: [DONE]\n\n")
    [row] = ledger(gateway)
    assert (row.prompt_tokens, row.completion_tokens, row.finish_reason) == (*FAKE_USAGE, "stop")
    assert row.key_id is None and row.ttft_ms is not None


def test_an_alias_reaches_the_node_as_its_model_and_is_booked_under_it(gateway):
    record = RequestRecord("alias")

    async def work(gw: Gateway) -> int:
        body, raw = chat("fm")
        reply = await gw.exchanges.open(ANONYMOUS, CHAT, body, raw, {}, record)
        await gw.exchanges.read(reply)
        return reply.status

    assert running(gateway, work) == 200  # the fake node 404s any other model name
    assert record.model == MODEL
    assert [r.model for r in ledger(gateway)] == [MODEL]


def test_a_key_scoped_to_other_models_is_told_its_model_does_not_exist(gateway):
    key, _ = gateway.keys.create("acme", models=["another-model"])

    async def work(gw: Gateway) -> None:
        body, raw = chat()
        await gw.exchanges.open(Principal(key), CHAT, body, raw, {})

    with pytest.raises(HelexaError) as refused:
        running(gateway, work)
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")
    assert ledger(gateway) == [] and gateway.router.in_flight == {}


def test_a_prompt_past_the_context_is_refused_at_the_edge_with_advice_for_its_client(gateway):
    async def work(gw: Gateway) -> None:
        body, _ = chat()
        body["messages"][0]["content"] = "word " * 8192  # ~10,240 tokens; the node has 8,192
        raw = msgspec.json.encode(body)  # the bytes as received are the body's
        await gw.exchanges.open(ANONYMOUS, CHAT, body, raw, {"user-agent": "opencode/0.5"})

    with pytest.raises(HelexaError) as refused:
        running(gateway, work)
    assert refused.value.code == "context_length_exceeded"
    assert "limit.context to 8192" in refused.value.extra_headers["X-Helexa-Advice"]
    assert ledger(gateway) == []


def test_a_budgeted_key_reserves_its_bound_and_settles_to_what_the_node_used(gateway):
    key, _ = gateway.keys.create("acme", cap_tokens=1000)
    seen: dict[str, Any] = {}

    async def work(gw: Gateway) -> None:
        body, raw = chat(max_tokens=5000)
        reply = await gw.exchanges.open(Principal(key), CHAT, body, raw, {})
        res = reply.exchange.reservation
        seen["reserved"] = res.tokens, gw.budgets.outstanding()[0]
        seen["max_tokens"] = res.max_output, body["max_tokens"], reply.exchange.prompt_estimate
        await gw.exchanges.read(reply)
        seen["after"] = gw.budgets.outstanding()

    running(gateway, work)
    tokens, outstanding = seen["reserved"]
    max_output, sent, prompt_estimate = seen["max_tokens"]
    assert tokens == outstanding == 1000  # the whole cap: 5000 asked, the rest of it given
    assert sent == max_output == 1000 - prompt_estimate
    assert seen["after"] == (0, 0.0)
    [row] = ledger(gateway)
    assert (row.prompt_tokens, row.completion_tokens) == FAKE_USAGE


def test_a_node_that_cannot_be_reached_is_a_503_and_writes_no_ledger_row(gateway):
    record = RequestRecord("gone")

    async def work(gw: Gateway) -> None:
        node = gw.fleet.nodes["fake"]
        node.endpoints[MODEL] = f"http://127.0.0.1:{free_port()}"  # nobody listens there
        body, raw = chat()
        await gw.exchanges.open(ANONYMOUS, CHAT, body, raw, {}, record)

    with pytest.raises(HelexaError) as refused:
        running(gateway, work)
    assert refused.value.status == 503
    assert "node fake could not be reached" in refused.value.message
    assert not gateway.fleet.nodes["fake"].up  # it leaves routing until it answers again
    assert record.open_parts == 1 and record.node is None
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert ledger(gateway) == []  # no model ran: the books grow only with work


def test_node_headers_carry_the_principal_and_never_the_clients_credentials_or_claims(gateway):
    key, _ = gateway.keys.create("acme")
    client = {
        "authorization": "Bearer hx-secret",
        "x-api-key": "hx-secret",
        "x-helexa-account-id": "someone-else",
        "x-request-id": "abc",
        "anthropic-version": "2023-06-01",
        "host": "gateway.example",
    }
    headers = gateway.exchanges.node_headers(client, Principal(key), drop=("anthropic-version",))
    assert headers == {
        "x-request-id": "abc",
        "x-helexa-via": "gateway",
        "x-helexa-account-id": "acme",
        "x-helexa-key-id": key.id,
    }


# -- what the books read from an answer -------------------------------------------------


def chunk(**delta: Any) -> bytes:
    return sse_data({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def responses_event(kind: str, **fields: Any) -> bytes:
    return sse_event(kind, {"type": kind, **fields})


def fed(tally: Tally, stream: bytes, sizes: int | None = None) -> Tally:
    """`stream` fed in pieces of `sizes` bytes (None: whole)."""
    step = sizes or len(stream)
    for at in range(0, len(stream), step):
        tally.feed(stream[at : at + step])
    return tally


def test_a_cut_stream_counts_reasoning_and_tool_call_argument_deltas_as_text():
    stream = b"".join(
        [
            chunk(role="assistant", content=""),  # no text yet
            chunk(reasoning_content="Let me"),
            chunk(reasoning_content=" think."),
            chunk(content="Calling it."),
            chunk(
                tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]
            ),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a":'}}]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
        ]
    )
    tally = fed(Tally(), stream)
    assert tally.text_events == 5
    assert tally.finish_reason is None and tally.usage is None  # cut before the end


def test_a_content_key_split_across_two_tcp_chunks_is_still_counted():
    stream = chunk(content="Hello") + chunk(content=" world")
    split = stream.index(b'"content":"') + 5  # mid-key: `"cont` | `ent":"Hello"...`
    tally = Tally()
    tally.feed(stream[:split])
    assert tally.text_events == 0  # nothing whole yet
    tally.feed(stream[split:])
    assert tally.text_events == 2
    assert fed(Tally(), stream, sizes=1).text_events == 2  # a byte at a time, the same


def test_a_streams_finish_reason_and_usage_are_the_last_ones_sent():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    stream = b"".join(
        [
            chunk(content="a"),
            sse_data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
            sse_data({"choices": [], "usage": usage}),
            b"data: [DONE]\n\n",
        ]
    )
    tally = fed(Tally(), stream, sizes=7)
    assert (tally.text_events, tally.finish_reason, tally.usage) == (1, "length", usage)


def test_completions_text_and_responses_deltas_count_and_responses_usage_is_read():
    completions = sse_data({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
    assert fed(Tally(), completions).text_events == 1
    usage = {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}
    responses = b"".join(
        [
            responses_event("response.created", response={"usage": None}),
            responses_event("response.reasoning_summary_text.delta", delta="hm"),
            responses_event("response.output_text.delta", delta="ok"),
            responses_event("response.output_text.delta", delta=""),
            responses_event("response.function_call_arguments.delta", delta="{}"),
            responses_event("response.completed", response={"usage": usage}),
        ]
    )
    tally = fed(Tally(), responses, sizes=13)
    assert (tally.text_events, tally.usage) == (3, usage)


def _close_cut(sessions, ex: Exchange) -> tuple[tuple[int, int, int, int], SpendRecord]:
    """Settle a cut exchange through the real books' writer; its counts and ledger row."""
    engine = sessions.kw["bind"]

    async def main() -> tuple[int, int, int, int]:
        books = Ledger.over(engine)
        books.start()
        accountant = Accountant(Budgets(books), books, GatewayMetrics(Fleet([])))
        counts, durable = accountant.close(ex, 499)
        await durable
        await books.close()
        return counts

    counts = asyncio.run(main())
    with sessions() as s:
        [row] = s.scalars(select(SpendRecord)).all()
    return counts, row


def test_a_cut_stream_the_node_cannot_account_for_is_booked_from_its_estimate_and_events(
    sessions,
):
    ex = Exchange(MODEL, prompt_estimate=40, price=Price(IN_PRICE, OUT_PRICE), cut=True)
    stream = chunk(content="one") + chunk(reasoning_content="two") + chunk(content="thr")
    fed(ex.tally, stream[:-3], sizes=10)  # the client left mid-event

    counts, row = _close_cut(sessions, ex)
    assert counts == (40, 2, 0, 0, 0)
    assert (row.prompt_tokens, row.completion_tokens, row.finish_reason) == (40, 2, None)
    assert (row.status, row.cost_usd) == (499, pytest.approx(cost_usd(40, 2, IN_PRICE, OUT_PRICE)))


def test_a_cut_stream_is_booked_from_what_the_node_says_it_generated_never_below_the_events(
    sessions,
):
    ex = Exchange(MODEL, prompt_estimate=40, cut=True)
    fed(ex.tally, chunk(content="a") + chunk(content="b") + chunk(content="c"), sizes=7)
    # held back in the node's detokenizer, or generated after the client left: more
    ex.node_usage = {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}
    assert _close_cut(sessions, ex)[0] == (31, 9, 0, 0, 0)
    # a node that under-reports is never believed below what arrived
    ex2 = Exchange(MODEL, prompt_estimate=40, cut=True)
    fed(ex2.tally, chunk(content="a") + chunk(content="b") + chunk(content="c"), sizes=7)
    ex2.node_usage = {"prompt_tokens": 31, "completion_tokens": 1}
    assert settled_counts(ex2) == (31, 3, 0, 0, 0)


def test_an_error_envelope_that_ran_the_model_is_booked_from_its_usage():
    ex = Exchange(MODEL, prompt_estimate=40)
    usage = {"prompt_tokens": 20, "completion_tokens": 17, "total_tokens": 37}
    envelope = {"error": {"message": "no tool call", "type": "x", "code": "y", "usage": usage}}
    ex.tally.whole(msgspec.json.encode(envelope))
    assert settled_counts(ex) == (20, 17, 0, 0, 0)
    # an error that never ran the model books nothing (not the prompt estimate)
    ex2 = Exchange(MODEL, prompt_estimate=40)
    ex2.tally.whole(b'{"error": {"message": "bad", "type": "x", "code": null}}')
    assert settled_counts(ex2) == (0, 0, 0, 0, 0)


def test_a_streams_end_is_its_done_or_its_error_event_however_its_bytes_are_split():
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    error = {"error": {"message": "no call", "type": "x", "code": "y", "usage": usage}}
    failed = chunk(content="a") + sse_data(error)
    tally = Tally()
    assert [tally.feed(failed[:-9]), tally.feed(failed[-9:])] == [False, True]
    assert (tally.usage, tally.error) == (usage, True)
    done = chunk(content="a") + b"data: [DONE]\n\n"
    tally = Tally()
    assert [tally.feed(done[:-4]), tally.feed(done[-4:])] == [False, True]
