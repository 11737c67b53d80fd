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

from helexa.config import load_config
from helexa.gateway.catalogue import model_list
from helexa.web.gateway_app import create_gateway_apps
from helexa.web.gateway_deps import STATE_KEY
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


def _both_doors(tmp, node, work):
    """`work(outer, litestar, model)` with two clients over one started gateway: one through
    its outer layer, one straight into its Litestar app."""
    outer, _metrics = create_gateway_apps(_config(tmp, node))
    gateway = outer.app.state[STATE_KEY]

    async def main():
        await gateway.start()
        try:
            deadline = time.monotonic() + 30
            while not model_list(gateway.router, 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            [model] = [m["id"] for m in model_list(gateway.router, 0)]
            clients = [
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
                for app in (outer, outer.app)
            ]
            try:
                return await work(*clients, model)
            finally:
                for c in clients:
                    await c.aclose()
        finally:
            await gateway.stop()

    return asyncio.run(main())


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Capital?"}], **kw}


def _events(text: str) -> list[dict]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_both_doors_give_the_same_answers_streams_and_errors(tmp_path, node):
    big = json.dumps(_chat("m", padding="x" * (1 << 20)))  # past max_body_mb = 1

    async def work(outer, litestar, model):
        seen = []
        for client in (outer, litestar):
            whole = await client.post("/v1/chat/completions", json=_chat(model))
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

    through_outer, through_litestar = _both_doors(tmp_path, node, work)
    for whole, stream, completion, bad, not_object, unknown, too_big in (
        through_outer,
        through_litestar,
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
    # the same bodies, status and envelopes through either door (ids and times aside)
    for a, b in zip(through_outer[3:], through_litestar[3:], strict=True):
        assert (a.status_code, a.json()) == (b.status_code, b.json())
    counts = [r[0].json()["usage"] for r in (through_outer, through_litestar)]
    assert len({(u["prompt_tokens"], u["completion_tokens"]) for u in counts}) == 1


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
