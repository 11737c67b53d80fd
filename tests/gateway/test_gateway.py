"""A real gateway in front of two real nodes: routing, aliases, cold loads, failover, the
streaming pass-through."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import free_port, start_node
from tests.web.test_node_lifecycle import HeldStream, _wait_for

LONG = {"max_tokens": 8000, "ignore_eos": True}


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("fleet")
    tiny, long = str(model_dirs["tiny"]), str(model_dirs["long"])
    nodes = {name: start_node(tmp / name, [tiny, long]) for name in ("a", "b")}
    gw = start_gateway(
        tmp,
        nodes,
        models=[
            {"id": tiny},
            {"id": long},
            {"id": str(model_dirs["scripted"]), "pinned_on": ["b"], "cost": {"input": 1.5}},
        ],
        aliases={"small": tiny},
    )
    yield gw, nodes
    gw.stop()
    for node in nodes.values():
        node.stop()


def test_v1_models_lists_the_catalogue_what_is_loaded_and_the_aliases(fleet, tiny_id, scripted_id):
    gw, _ = fleet
    models = gw.models()
    tiny = models[tiny_id]
    assert tiny["loaded"] and tiny["status"] == "loaded"
    assert [loc["node"] for loc in tiny["locations"]] == ["a", "b"]
    assert tiny["feasible_on"] == ["a", "b"]
    assert tiny["limit"]["context"] == 256 and tiny["max_model_len"] == 256
    scripted = models[scripted_id]
    assert scripted["status"] == "available" and not scripted["loaded"]
    # the prompt cache's prices, unset, are the input price
    assert scripted["cost"] == {"input": 1.5, "output": 0.0, "cache_read": 1.5, "cache_write": 1.5}
    assert models["small"]["alias_of"] == tiny_id
    assert models["small"]["limit"] == tiny["limit"]


def test_an_alias_reaches_the_node_as_its_concrete_model(fleet, tiny_id):
    gw, _ = fleet
    r = gw.post("/v1/chat/completions", _chat("small", max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == tiny_id  # the node saw the concrete id


def test_requests_go_to_the_least_busy_replica_and_follow_the_load(fleet, long_id):
    gw, nodes = fleet

    def served_by() -> str:
        r = gw.post("/v1/chat/completions", _chat(long_id, max_tokens=2))
        assert r.status_code == 200, r.text
        return r.headers["x-helexa-node"]

    # Two held streams make a replica busy: a request of ours just answered may still count
    # once on the other (the gateway ends its bookkeeping a moment after the last byte), and
    # a tie goes by name.
    held = [HeldStream(nodes["a"], _chat(long_id, **LONG)) for _ in range(2)]  # not via us
    try:
        _wait_for(lambda: _node_load(gw, "a", long_id) >= 2)
        assert {served_by() for _ in range(3)} == {"b"}
    finally:
        for h in held:
            h.close()
    held = [HeldStream(nodes["b"], _chat(long_id, **LONG)) for _ in range(2)]
    try:
        _wait_for(lambda: _node_load(gw, "b", long_id) >= 2 and _node_load(gw, "a", long_id) == 0)
        assert {served_by() for _ in range(3)} == {"a"}
    finally:
        for h in held:
            h.close()


def _node_load(gw, node: str, model: str) -> int:
    """The load the gateway last polled: `in_flight` on the node's /health, via its own."""
    for n in gw.get("/health").json()["nodes"]:
        if n["name"] == node:
            return n["load"].get(model, 0)
    raise KeyError(node)


def test_the_first_chunk_arrives_while_the_node_is_still_generating(fleet, long_id):
    gw, nodes = fleet
    body = _chat(long_id, stream=True, max_tokens=2000, ignore_eos=True)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        node = nodes[r.headers["x-helexa-node"]]
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                model = next(m for m in node.get("/health").json()["models"] if m["id"] == long_id)
                assert model["in_flight"] == 1  # not buffered: the node is mid-answer
                break
    # leaving mid-stream cancels the upstream request: the node frees the slot
    _wait_for(
        lambda: (
            next(m for m in node.get("/health").json()["models"] if m["id"] == long_id)["in_flight"]
            == 0
        ),
        timeout=10,
    )


def test_ten_concurrent_requests_for_a_cold_model_load_it_once_on_its_pinned_node(
    fleet, scripted_id
):
    gw, nodes = fleet
    with ThreadPoolExecutor(10) as pool:
        results = list(
            pool.map(lambda _: gw.post("/v1/chat/completions", _chat(scripted_id)), range(10))
        )
    assert [r.status_code for r in results] == [200] * 10, results[0].text
    assert {r.headers["x-helexa-node"] for r in results} == {"b"}  # pinned there
    assert nodes["b"].log().count(f"loading model {scripted_id}") == 1
    assert f"loading model {scripted_id}" not in nodes["a"].log()
    assert gw.models()[scripted_id]["loaded"]


def test_an_unknown_model_is_a_404_model_not_found(fleet):
    gw, _ = fleet
    r = gw.post("/v1/chat/completions", _chat("no/such-model"))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(gw.v1 + "/chat/completions", content=b"{oops", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


def test_node_validation_errors_pass_through_as_they_are(fleet, tiny_id):
    gw, _ = fleet
    r = gw.post("/v1/chat/completions", _chat(tiny_id, temperature="hot"))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"


def test_metrics_count_tokens_from_the_nodes_usage_per_model_and_node(fleet, tiny_id):
    gw, _ = fleet
    r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=3, ignore_eos=True))
    node = r.headers["x-helexa-node"]
    assert gw.get("/no/such/path/123").status_code == 404
    text = httpx.get(gw.metrics_url + "/metrics", timeout=10).text
    label = f'model="{tiny_id}",node="{node}"'
    assert f"helexa_completion_tokens_total{{{label}}}" in text
    assert "helexa_time_to_first_token_seconds_bucket{" in text
    assert "helexa_tokens_per_second_bucket{" in text
    assert 'helexa_node_up{node="a"} 1.0' in text
    assert 'helexa_requests_total{code="200",route="/v1/chat/completions"}' in text
    text = httpx.get(gw.metrics_url + "/metrics", timeout=10).text
    assert 'helexa_requests_total{code="404",route="other"}' in text  # no label per path
    assert "/no/such/path" not in text


def test_a_sigkilled_node_leaves_routing_and_its_traffic_goes_to_the_other(fleet, tiny_id):
    gw, nodes = fleet
    nodes["a"].stop(signal.SIGKILL)
    served = []
    for _ in range(6):
        r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2))
        assert r.status_code == 200, r.text
        served.append(r.headers["x-helexa-node"])
    assert set(served) == {"b"}
    _wait_for(lambda: 'helexa_node_up{node="a"} 0.0' in httpx.get(gw.metrics_url + "/metrics").text)
    assert "node a" in gw.log() and "leaves routing" in gw.log()


# -- one small node: eviction, pinning, backpressure ------------------------------------------


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("small-fleet")
    tiny, tiny2, scripted = (str(model_dirs[k]) for k in ("tiny", "tiny2", "scripted"))
    # tiny 28 MiB + scripted 17 fit in 60; tiny + scripted + tiny2 (28) do not
    node = start_node(
        tmp / "c",
        [tiny],
        node={"max_model_memory_mb": 60, "max_running_requests": 1, "max_waiting_requests": 0},
    )
    gw = start_gateway(
        tmp,
        {"c": node},
        models=[{"id": tiny, "pinned_on": ["c"]}, {"id": tiny2}, {"id": scripted}],
    )
    yield gw, node, (tiny, tiny2, scripted)
    gw.stop()
    node.stop()


def test_cold_loads_evict_the_least_recently_used_unpinned_model(small_fleet):
    gw, node, (tiny, tiny2, scripted) = small_fleet

    def loaded() -> set[str]:
        return {m["id"] for m in node.get("/models").json() if m["status"] == "loaded"}

    assert gw.post("/v1/chat/completions", _chat(scripted)).status_code == 200
    assert loaded() == {tiny, scripted}
    r = gw.post("/v1/chat/completions", _chat(tiny2, max_tokens=2))
    assert r.status_code == 200, r.text
    assert loaded() == {tiny, tiny2}  # scripted went; the pinned tiny stayed
    assert gw.post("/v1/chat/completions", _chat(tiny, max_tokens=2)).status_code == 200
    assert gw.post("/v1/chat/completions", _chat(scripted)).status_code == 200
    assert loaded() == {tiny, scripted}  # tiny2 was the least recently used unpinned
    assert "evicting" in gw.log()


def test_a_nodes_503_and_retry_after_reach_the_client_intact(small_fleet):
    gw, node, (tiny, _, _) = small_fleet
    held = HeldStream(node, _chat(tiny, max_tokens=240, ignore_eos=True))
    try:
        r = gw.post("/v1/chat/completions", _chat(tiny, max_tokens=2))
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        held.close()


def test_with_no_healthy_node_requests_get_503_with_retry_after(tmp_path, small_fleet):
    _, _, (tiny, _, _) = small_fleet
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw = start_gateway(tmp_path, {"gone": gone}, models=[{"id": tiny}], wait_up=False)
    try:
        r = gw.post("/v1/chat/completions", _chat(tiny))
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "5"
        assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        gw.stop()


def test_sse_bytes_pass_through_unchanged(small_fleet):
    gw, node, (tiny, _, _) = small_fleet
    body = _chat(tiny, stream=True, max_tokens=5, temperature=0, ignore_eos=True)

    def events(base: str) -> list[dict]:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            data = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return [json.loads(x) for x in data[:-1]]

    via_gw, direct = events(gw.base_url), events(node.base_url)
    strip = lambda cs: [{k: v for k, v in c.items() if k not in ("id", "created")} for c in cs]  # noqa: E731
    assert strip(via_gw) == strip(direct)


def test_sigterm_lets_a_proxied_stream_finish_then_the_gateway_exits_zero(tmp_path, small_fleet):
    _, node, (tiny, _, _) = small_fleet
    gw = start_gateway(tmp_path, {"c": node})
    body = _chat(tiny, stream=True, max_tokens=150, ignore_eos=True)
    lines: list[str] = []
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 2:
                gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(next(x for x in reversed(lines) if '"usage"' in x)[6:])["usage"]
    assert usage["completion_tokens"] == 150
