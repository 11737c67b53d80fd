"""The books exact to the token under load (issue 40): a real gateway in front of a real
node, both processes, with the machine's CPUs taken by busy neighbours, and 56 requests at
once — streams in three APIs (a third cut by their client, some before any text), whole
answers, metered and anonymous. Afterwards the ledger holds, for every request the engine
ran, the tokens the node processed for it: summed, the node's own counters
(`helexa_prompt_tokens_total` + `helexa_generation_tokens_total`); request by request, the
node's log line for it (the metered ones: each has a key of its own)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select

from helexa.db.models import SpendRecord
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.gateway.test_money import _node_idle, _node_tokens, _sessions
from tests.web.node_proc import NodeProcess, start_node

N = 56
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dirs) -> Iterator[NodeProcess]:
    proc = start_node(
        tmp_path_factory.mktemp("load-node"),
        [str(model_dirs["long"])],
        node={"per_principal_max": 0, "max_waiting_requests": 512},
    )
    yield proc
    proc.stop()


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """Two processes that spin for the test's length: every CPU of a 2-core machine taken."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in spin:
        p.kill()
        p.wait()


def _text_events(line: str) -> int:
    """1 when an SSE data line carries generated text (chat, Responses or Anthropic)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return 0
    obj = json.loads(line[6:])
    delta = ((obj.get("choices") or [{}])[0] or {}).get("delta") or {}
    if delta.get("content") or delta.get("reasoning_content"):
        return 1
    if obj.get("type") == "response.output_text.delta" and obj.get("delta"):
        return 1
    inner = obj.get("delta") if obj.get("type") == "content_block_delta" else None
    return int(bool(isinstance(inner, dict) and inner.get("text")))


async def _one(client: httpx.AsyncClient, gw, model: str, i: int, secret: str | None) -> dict:
    """Request `i`: its API, streaming, and where its client leaves follow from i."""
    api = ("chat", "responses", "messages")[i % 3]
    stream = i % 8 != 7
    cut_after = None
    if stream and i % 3 == 0:
        cut_after = 0 if i % 9 == 0 else 1 + i % 5  # 0: after the first line, before text
    ask = [{"role": "user", "content": f"Tell me a story, number {i}."}]
    body: dict = {"model": model, "stream": stream, "ignore_eos": True}
    if api == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": ask, "max_tokens": MAX_TOKENS}
    elif api == "responses":
        path, body = "/v1/responses", {**body, "input": ask, "max_output_tokens": MAX_TOKENS}
    else:
        path, body = "/v1/messages", {**body, "messages": ask, "max_tokens": MAX_TOKENS}
    rid = f"load-{i}"
    headers = {"x-request-id": rid}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    out = {"i": i, "rid": rid, "api": api, "stream": stream, "cut": cut_after is not None}
    if not stream:
        r = await client.post(gw.base_url + path, json=body, headers=headers)
        out["status"] = r.status_code
        return out
    seen = 0
    async with client.stream("POST", gw.base_url + path, json=body, headers=headers) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            seen += _text_events(line)
            if cut_after is not None and (line.startswith("data: ") and seen >= cut_after):
                break  # the client leaves: the connection is closed under the stream
    return out


def _node_lines(node: NodeProcess) -> dict[str, dict]:
    """The node's request log lines by request id, their numbers read (None: not given)."""
    lines = {}
    for raw in node.log().splitlines():
        if "request_id='load-" not in raw:
            continue
        fields = {k: v.strip("'") for k, v in re.findall(r"(\w+)=('[^']*'|\S+)", raw)}
        for k in ("prompt_tokens", "completion_tokens", "ttft_ms"):
            fields[k] = None if fields.get(k) in (None, "None") else float(fields[k])
        lines[fields["request_id"]] = fields
    return lines


def test_the_ledger_holds_what_the_node_processed_for_every_request_under_load(
    tmp_path, node, model_dirs, busy_cpus
):
    model = str(model_dirs["long"])
    gw = start_gateway(tmp_path, {"n": node}, models=[{"id": model}])
    try:
        store = KeyStore(_sessions(gw.database_url))
        keys: dict[int, str] = {}  # request -> its key's id (every other one is metered)
        secrets: dict[int, str | None] = {}
        for i in range(N):
            if i % 2:
                secrets[i] = None
                continue
            info, secret = store.create(f"load-{i}", cap_tokens=10**9)
            keys[i], secrets[i] = info.id, secret
        before = _node_tokens(node)

        async def run() -> list[dict]:
            limits = httpx.Limits(max_connections=N)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                return await asyncio.gather(
                    *(_one(client, gw, model, i, secrets[i]) for i in range(N))
                )

        results = asyncio.run(run())
        assert {r["status"] for r in results} == {200}, results
        assert sum(r["cut"] for r in results) >= N // 4
        _node_idle(node, timeout_s=120)
        processed = _node_tokens(node) - before
        assert processed > 0
        sessions = _sessions(gw.database_url)
        deadline = time.monotonic() + 60  # cut streams settle off their requests' paths
        while True:
            with sessions() as s:
                rows = list(s.scalars(select(SpendRecord)))
            billed = sum(r.prompt_tokens + r.completion_tokens for r in rows)
            if billed >= processed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert billed == processed, (billed, processed, len(rows))
        # request by request (the metered ones), against the node's log line for it
        lines = _node_lines(node)
        by_key = {r.key_id: r for r in rows if r.key_id}
        for i, key_id in keys.items():
            line = lines[f"load-{i}"]
            row = by_key.get(key_id)
            node_prompt = line.get("prompt_tokens") or 0
            node_completion = line.get("completion_tokens") or 0
            if row is None:  # the engine never ran it: nothing processed, nothing billed
                assert node_prompt == node_completion == 0, (i, line)
                continue
            assert (row.prompt_tokens, row.completion_tokens) == (
                node_prompt,
                node_completion,
            ), (i, results[i], line)
            # the time to the first token, not to the role chunk (none where the client
            # left before any text came)
            if not results[i]["cut"]:
                assert row.ttft_ms is not None, (i, line)
            if row.ttft_ms is not None:
                assert line["ttft_ms"] <= row.ttft_ms <= row.latency_ms, (i, line)
        assert gw.get("/health").json()["budget_reserved_tokens"] == 0
    finally:
        gw.stop()
