"""The OpenAI pass-through routes answered past Litestar (`helexa.web.gateway_passthrough`):
the same answers, errors and headers whether a request comes through the gateway's outer
layer (which sends it straight to the pass-through) or through the Litestar app (whose
handlers hand it the same app). A real node process answers; the gateway runs in-process
so that both of its doors can be knocked on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import uvicorn

from helexa.config import load_config
from helexa.gateway.catalogue import model_list
from helexa.web.connection_guard import guarded_protocol
from helexa.web.gateway_app import create_gateway_apps
from helexa.web.gateway_deps import STATE_KEY
from helexa.web.gateway_lane import Lane, lane_protocol
from tests.web.node_proc import scripted_model, start_node

SCRIPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pass-node")
    proc = start_node(tmp, [scripted_model(tmp, SCRIPT)])
    yield proc
    proc.stop()


def _config(tmp, node):
    path = tmp / "helexa.toml"
    path.write_text(
        f'[node]\nstate_dir = "{tmp}"\n[gateway]\nlisten = "127.0.0.1:1"\n'
        "poll_interval_s = 0.2\n[http]\nmax_body_mb = 1\n"
        f'[[nodes]]\nname = "n"\nendpoint = "{node.base_url}"\n'
    )
    return load_config(path, env={})


def _doors(tmp, node, work):
    """`work(outer, litestar, lane, model)` with three clients over one started gateway: one
    through its outer layer, one straight into its Litestar app, and one over a socket to
    uvicorn with the gateway's lane, as `helexa serve` runs it."""
    cfg = _config(tmp, node)
    outer, _metrics = create_gateway_apps(cfg)
    gateway = outer.app.state[STATE_KEY]
    protocol = guarded_protocol(cfg.http.header_timeout_s, None, (lane_protocol(Lane(outer)),))
    server = uvicorn.Server(
        uvicorn.Config(
            outer, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_config=None
        )
    )

    async def main():
        await gateway.start()
        serving = asyncio.create_task(server.serve())
        try:
            deadline = time.monotonic() + 30
            while not (server.started and model_list(gateway.router, 0)):
                assert time.monotonic() < deadline and not serving.done()
                await asyncio.sleep(0.1)
            [model] = [m["id"] for m in model_list(gateway.router, 0)]
            port = server.servers[0].sockets[0].getsockname()[1]
            clients = [
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
                for app in (outer, outer.app)
            ]
            clients.append(httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}"))
            try:
                return await work(*clients, model)
            finally:
                for c in clients:
                    await c.aclose()
        finally:
            server.should_exit = True
            await serving
            await gateway.stop()

    return asyncio.run(main())


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Capital?"}], **kw}


def _events(text: str) -> list[dict]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_every_door_gives_the_same_answers_streams_and_errors(tmp_path, node):
    big = json.dumps(_chat("m", padding="x" * (1 << 20)))  # past max_body_mb = 1

    async def work(outer, litestar, lane, model):
        seen = []
        for client in (outer, litestar, lane):
            whole = await client.post(
                "/v1/chat/completions", json=_chat(model), headers={"x-request-id": "trace-1"}
            )
            stream = await client.post(
                "/v1/chat/completions", json=_chat(model, stream=True, max_tokens=64)
            )
            completion = await client.post(
                "/v1/completions", json={"model": model, "prompt": "Capital?"}
            )
            bad = await client.post(
                "/v1/chat/completions",
                content=b'{"model":',
                headers={"content-type": "application/json"},
            )
            not_object = await client.post("/v1/responses", json=[1])
            unknown = await client.post("/v1/chat/completions", json=_chat("no-such-model"))
            too_big = await client.post(
                "/v1/chat/completions",
                content=big.encode(),
                headers={"content-type": "application/json"},
            )
            seen.append((whole, stream, completion, bad, not_object, unknown, too_big))
        return seen

    through_outer, through_litestar, through_lane = _doors(tmp_path, node, work)
    for whole, stream, completion, bad, not_object, unknown, too_big in (
        through_outer,
        through_litestar,
        through_lane,
    ):
        assert whole.status_code == 200
        assert whole.headers["content-type"] == "application/json"
        assert whole.headers["x-helexa-node"] == "n"
        assert whole.json()["choices"][0]["message"]["content"] == SCRIPT
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "text/event-stream; charset=utf-8"
        text = "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in _events(stream.text)
            if e["choices"]
        )
        assert text == SCRIPT
        assert completion.json()["choices"][0]["text"] == SCRIPT
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "body")
        assert "not valid JSON" in bad.json()["error"]["message"]
        assert not_object.status_code == 400
        assert not_object.json()["error"]["message"] == "the request body must be a JSON object"
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
        assert (too_big.status_code, too_big.json()["error"]["code"]) == (413, "request_too_large")
    # the request's id, once (a node's echo of it is not passed on), from the doors that
    # `helexa serve` runs (the Litestar app alone sets none)
    for whole, stream, *_ in (through_outer, through_lane):
        assert whole.headers["x-request-id"] == "trace-1"
        assert "," not in stream.headers["x-request-id"]
    assert "x-request-id" not in through_litestar[0].headers
    # the same bodies, status and envelopes through every door (ids and times aside)
    for a, b, c in zip(through_outer[3:], through_litestar[3:], through_lane[3:], strict=True):
        assert (a.status_code, a.json()) == (b.status_code, b.json()) == (c.status_code, c.json())
    counts = [r[0].json()["usage"] for r in (through_outer, through_litestar, through_lane)]
    assert len({(u["prompt_tokens"], u["completion_tokens"]) for u in counts}) == 1
    # and the same headers, less those of one answer (its id, date, length and framing)
    own = {"x-request-id", "date", "server", "content-length", "transfer-encoding"}
    for i in range(len(through_outer)):
        heads = [
            {k: v for k, v in r[i].headers.items() if k not in own}
            for r in (through_outer, through_lane)
        ]
        assert heads[0] == heads[1], i


def test_a_client_that_leaves_mid_body_is_answered_499_into_the_void(tmp_path):
    """The ASGI contract straight: the body's first bytes, then the client's disconnect.
    Nothing is raised into the server (which would log it as the app's failure): the
    request ends as a 499, which its log line and the request counter then show."""
    path = tmp_path / "helexa.toml"
    path.write_text(f'[node]\nstate_dir = "{tmp_path}"\n[gateway]\nlisten = "127.0.0.1:1"\n')
    outer, _metrics = create_gateway_apps(load_config(path, env={}))
    messages = [
        {"type": "http.request", "body": b'{"model": "m", "mess', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(outer.passthrough(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 499


def _raw_request(
    model: str,
    *,
    stream: bool = False,
    extra: str = "",
    version: str = "1.1",
    target: str = "/v1/chat/completions",
):
    body = json.dumps(_chat(model, stream=stream, max_tokens=16)).encode()
    head = (
        f"POST {target} HTTP/{version}\r\nHost: gw\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode(), body


async def _read_answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.1 answer off the stream: its status line, headers and (de-chunked) body."""
    status = (await reader.readline()).decode().strip()
    headers = {}
    while (line := (await reader.readline()).decode().strip()) != "":
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return status, headers, body


def test_the_lane_keeps_http_11_pipelining_100_continue_and_10_close(tmp_path, node):
    """What uvicorn did for these routes, the lane does on the socket: two requests sent
    together are answered in order on one connection; `Expect: 100-continue` gets its 100
    before the body is sent; an HTTP/1.0 request is answered and its connection closed."""

    async def work(outer, litestar, lane, model):
        host, port = lane.base_url.host, lane.base_url.port
        reader, writer = await asyncio.open_connection(host, port)
        first, second = _raw_request(model), _raw_request(model, stream=True)
        writer.write(first[0] + first[1] + second[0] + second[1])  # pipelined
        answers = [await _read_answer(reader), await _read_answer(reader)]
        head, body = _raw_request(model, extra="Expect: 100-continue\r\n")
        writer.write(head)
        continued = await reader.readline()
        await reader.readline()
        writer.write(body)
        answers.append(await _read_answer(reader))
        writer.close()
        reader, writer = await asyncio.open_connection(host, port)
        head, body = _raw_request(model, version="1.0")
        writer.write(head + body)
        answers.append(await _read_answer(reader))
        closed = await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        return answers, continued, closed

    answers, continued, closed = _doors(tmp_path, node, work)
    (s1, h1, b1), (s2, h2, b2), (s3, _, b3), (s4, h4, b4) = answers
    assert [s1, s2, s3, s4] == ["HTTP/1.1 200 OK"] * 4
    assert json.loads(b1)["choices"][0]["message"]["content"] == SCRIPT
    assert h2["content-type"] == "text/event-stream; charset=utf-8"
    assert (
        "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in _events(b2.decode())
            if e["choices"]
        )
        == SCRIPT
    )
    assert continued == b"HTTP/1.1 100 Continue\r\n"
    assert json.loads(b3)["choices"][0]["message"]["content"] == SCRIPT
    assert h4["connection"] == "close" and closed
    assert json.loads(b4)["choices"][0]["message"]["content"] == SCRIPT
    assert len({h1["x-request-id"], h2["x-request-id"], h4["x-request-id"]}) == 3


def test_lane_and_asgi_requests_share_a_connection_in_order(tmp_path, node):
    """On one connection, pipelined: a lane request, an ASGI one (the model list), a POST
    to a pass-through path with a query string (served by ASGI, as any target the lane does
    not take whole), and a lane request again; each answered, in the order sent."""

    async def work(outer, litestar, lane, model):
        reader, writer = await asyncio.open_connection(lane.base_url.host, lane.base_url.port)
        chat = _raw_request(model)
        query = _raw_request(model, target="/v1/chat/completions?trace=1")
        listing = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
        writer.write(b"".join([*chat, listing, *query, *chat]))
        answers = [await _read_answer(reader) for _ in range(4)]
        writer.close()
        return answers

    answers = _doors(tmp_path, node, work)
    assert [a[0] for a in answers] == ["HTTP/1.1 200 OK"] * 4
    for i in (0, 2, 3):
        assert json.loads(answers[i][2])["choices"][0]["message"]["content"] == SCRIPT
    assert [m["id"] for m in json.loads(answers[1][2])["data"]]
    assert len({a[1]["x-request-id"] for a in answers}) == 4
