"""What an operator reads, through a real gateway and node: `x-request-id` on every answer
(and passed to the node), one log line per API request with its tokens and timings, and a
start-up log without Alembic's chatter."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node

_FIELD = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\S+)")


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _message(model: str, **kw) -> dict:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **kw}


def request_line(gw, rid: str, timeout: float = 10.0) -> dict[str, str]:
    """The fields of the gateway's `request` line for `rid` (strings unquoted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in gw.log().splitlines():
            if f"request request_id='{rid}'" in line:
                text = line.split(" request request_id=", 1)[1]
                fields = dict(_FIELD.findall("request_id=" + text))
                return {k: v.strip("'") for k, v in fields.items()}
        time.sleep(0.1)
    raise AssertionError(f"no request line for {rid}:\n{gw.log()[-3000:]}")


def eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("request-log")
    node = start_node(tmp / "n", [model_dirs["tiny"], model_dirs["long"]], node={"api_key": "k1"})
    gw = start_gateway(
        tmp,
        {"n": node},
        models=[{"id": str(model_dirs["tiny"])}],
        gateway={"require_auth": True},
        node={"api_key": "k1"},
    )
    _, secret = KeyStore(session_factory(make_engine(gw.database_url))).create("ops")
    yield gw, node, {"Authorization": f"Bearer {secret}"}
    gw.stop()
    node.stop()


def test_a_sane_client_request_id_is_kept_passed_to_the_node_and_returned(fleet, tiny_id):
    gw, node, auth = fleet
    rid = "trace-01:ab.CD_ef"
    r = gw.post(
        "/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers={**auth, "x-request-id": rid}
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert r.headers.get_list("x-request-id") == [rid]  # not the node's copy beside ours
    assert eventually(lambda: rid in node.log())  # the node logged the same id


@pytest.mark.parametrize("given", [None, "", "has space", "a/b", "x" * 129, "semi;colon"])
def test_a_missing_or_insane_request_id_is_replaced_by_a_fresh_one(fleet, tiny_id, given):
    gw, node, auth = fleet
    headers = dict(auth) if given is None else {**auth, "x-request-id": given}
    r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers=headers)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and rid != given
    assert eventually(lambda: rid in node.log())


def test_every_answer_carries_a_request_id_errors_and_streams_included(fleet, tiny_id):
    gw, _, auth = fleet
    store = KeyStore(session_factory(make_engine(gw.database_url)))
    _, broke = store.create("ops", cap_tokens=1)
    answers = {
        "401": gw.post("/v1/chat/completions", _chat(tiny_id)),
        "401 anthropic": gw.post("/v1/messages", _message(tiny_id)),
        "404 model": gw.post("/v1/chat/completions", _chat("no/such"), headers=auth),
        "404 route": gw.get("/v1/nothing-here"),
        "405": gw.get("/v1/chat/completions"),
        "400": httpx.post(gw.v1 + "/chat/completions", content=b"{", headers=auth),
        "429": gw.post(
            "/v1/chat/completions", _chat(tiny_id), headers={"Authorization": f"Bearer {broke}"}
        ),
        "200 models": httpx.get(gw.v1 + "/models", headers=auth),
        "200 health": gw.get("/health"),
    }
    for what, r in answers.items():
        assert r.status_code == int(what[:3]), (what, r.text)
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers.get("x-request-id", "")), what
    for path, body in (
        ("/chat/completions", _chat(tiny_id, max_tokens=3, stream=True)),
        ("/messages", _message(tiny_id, stream=True)),
    ):
        headers = {**auth, "x-request-id": f"stream{path.replace('/', '-')}"}
        with httpx.stream("POST", gw.v1 + path, json=body, headers=headers, timeout=60) as s:
            assert s.status_code == 200
            assert s.headers["x-request-id"] == headers["x-request-id"]
            s.read()


def test_one_line_per_request_with_its_model_tokens_finish_and_timings(fleet, tiny_id):
    gw, _, auth = fleet
    r = gw.post(
        "/v1/chat/completions",
        _chat(tiny_id, max_tokens=5, ignore_eos=True),
        headers={**auth, "x-request-id": "line-plain"},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    line = request_line(gw, "line-plain")
    assert line["model"] == tiny_id and line["status"] == "200" and line["node"] == "n"
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"] == 5
    assert line["finish_reason"] == "length"
    assert 0 < float(line["ttft_ms"]) <= float(line["total_ms"])
    assert gw.log().count("request_id='line-plain'") == 1


def test_a_streams_line_is_written_when_it_ends_with_the_nodes_usage(fleet, tiny_id):
    gw, _, auth = fleet
    body = _chat(tiny_id, max_tokens=6, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}
    headers = {**auth, "x-request-id": "line-stream"}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=headers) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=chunks[-1][6:]).json()["usage"]
    line = request_line(gw, "line-stream")
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"] == 6
    assert line["finish_reason"] == "length" and "cut" not in line
    assert float(line["ttft_ms"]) < float(line["total_ms"])


def test_an_anthropic_stream_logs_the_nodes_token_counts(fleet, tiny_id):
    gw, _, auth = fleet
    headers = {**auth, "x-request-id": "line-anthropic"}
    body = _message(tiny_id, max_tokens=4, stream=True)
    with httpx.stream("POST", gw.v1 + "/messages", json=body, headers=headers) as s:
        data = [line for line in s.iter_lines() if line.startswith("data: ")]
    delta = next(d for d in data if '"message_delta"' in d)
    output_tokens = httpx.Response(200, content=delta[6:]).json()["usage"]["output_tokens"]
    line = request_line(gw, "line-anthropic")
    assert line["status"] == "200" and line["model"] == tiny_id
    assert int(line["completion_tokens"]) == output_tokens > 0


def test_a_stream_the_client_cuts_is_logged_when_it_ends(fleet, long_id):
    gw, _, auth = fleet
    body = _chat(long_id, max_tokens=8000, ignore_eos=True, stream=True)
    headers = {**auth, "x-request-id": "line-cut"}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=headers) as s:
        seen = 0
        for line in s.iter_lines():
            seen += '"content":"' in line and '"content":""' not in line
            if seen >= 3:
                break  # leave mid-answer
    line = request_line(gw, "line-cut")
    assert line["status"] == "200" and line["cut"] == "True"
    assert line["finish_reason"] == "None"
    assert 3 <= int(line["completion_tokens"]) < 8000


def test_refused_requests_are_logged_with_their_status(fleet, tiny_id):
    gw, _, _ = fleet
    r = gw.post("/v1/chat/completions", _chat(tiny_id), headers={"x-request-id": "line-401"})
    assert r.status_code == 401
    line = request_line(gw, "line-401")
    assert line["status"] == "401" and line["prompt_tokens"] == "None"


def test_a_fresh_database_is_migrated_without_alembic_info_lines(fleet):
    gw, _, _ = fleet
    log = gw.log()
    assert "alembic" not in log.lower(), log
    assert "Running upgrade" not in log and "Context impl" not in log
