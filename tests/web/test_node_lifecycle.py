"""Node processes under pressure and change: overload, principals, loading, faults, SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helexa.protocol.wire import EXCHANGE_HEADER, exchange_usage_path
from tests.web.node_proc import start_node

LONG = {"max_tokens": 8000, "ignore_eos": True}  # keeps a slot busy until the client leaves


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


class HeldStream:
    """A streaming request kept open (holding its running slot) until `close()`."""

    def __init__(self, node, body: dict, headers: dict | None = None) -> None:
        self.status: int | None = None
        self.lines: list[str] = []
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(node, body, headers or {}), daemon=True
        )
        self._thread.start()
        assert self._started.wait(30), "stream did not start"

    def _run(self, node, body, headers) -> None:
        with httpx.stream(
            "POST",
            node.v1 + "/chat/completions",
            json={**body, "stream": True},
            headers=headers,
            timeout=60,
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                if line.startswith("data: {") and '"content":' in line:
                    self._started.set()
                if self._stop.is_set() or r.status_code != 200:
                    break
        self._started.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _wait_for(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _load(node, model_id: str) -> dict:
    return next(m for m in node.get("/health").json()["models"] if m["id"] == model_id)


# -- admission ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_node(tmp_path_factory, model_dirs):
    """One running slot, one queue place: easy to overload."""
    node = start_node(
        tmp_path_factory.mktemp("small"),
        [model_dirs["long"], model_dirs["scripted"]],
        node={"max_running_requests": 1, "max_waiting_requests": 1, "max_queue_wait_s": 5.0},
    )
    yield node
    node.stop()


def test_overload_answers_503_with_retry_after_at_once_and_nothing_hangs(small_node, long_id):
    running = HeldStream(small_node, _chat(long_id, **LONG))
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(small_node.post, "/v1/chat/completions", _chat(long_id, max_tokens=2))
        _wait_for(lambda: _load(small_node, long_id)["queue_depth"] == 1)
        elapsed = []
        for _ in range(5):
            t0 = time.monotonic()
            r = small_node.post("/v1/chat/completions", _chat(long_id, max_tokens=2))
            elapsed.append(time.monotonic() - t0)
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded"
            # refused at the door, not after a queue wait of its own (that 503 says so:
            # test_a_request_queued_past_the_max_wait_gets_503)
            assert "queueing" not in err["message"], err
            assert int(r.headers["Retry-After"]) >= 1
        print(f"503 answered in {max(elapsed) * 1000:.0f} ms at worst")
        running.close()
        assert queued.result(timeout=30).status_code == 200  # the queued one is served next
    _wait_for(lambda: _load(small_node, long_id)["in_flight"] == 0)


def test_a_request_queued_past_the_max_wait_gets_503(small_node, long_id):
    running = HeldStream(small_node, _chat(long_id, **LONG))
    try:
        t0 = time.monotonic()
        r = small_node.post("/v1/chat/completions", _chat(long_id, max_tokens=2))
        waited = time.monotonic() - t0
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert "queueing" in r.json()["error"]["message"]
        assert waited >= 4.5  # it did wait its turn first
    finally:
        running.close()


def test_one_models_overload_does_not_touch_another_model(small_node, long_id, scripted_id):
    running = HeldStream(small_node, _chat(long_id, **LONG))
    try:
        r = small_node.post("/v1/chat/completions", _chat(scripted_id))
        assert r.status_code == 200
    finally:
        running.close()


@pytest.fixture(scope="module")
def gated_node(tmp_path_factory, model_dirs):
    """Principal headers count only with the node's api_key; per-principal cap 2."""
    node = start_node(
        tmp_path_factory.mktemp("gated"),
        [model_dirs["long"]],
        node={"api_key": "s3cret", "per_principal_max": 2, "metrics_token": "scrape-only"},
    )
    yield node
    node.stop()


def _principal(account: str, secret: str | None = "s3cret") -> dict:
    h = {"x-helexa-account-id": account, "x-helexa-key-id": f"key-{account}"}
    if secret:
        h["Authorization"] = f"Bearer {secret}"
    return h


def test_a_flooding_principal_gets_429_while_another_is_served(gated_node, long_id):
    a = [HeldStream(gated_node, _chat(long_id, **LONG), _principal("a")) for _ in range(2)]
    try:
        r = gated_node.post("/v1/chat/completions", _chat(long_id), headers=_principal("a"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
        b = gated_node.post(
            "/v1/chat/completions", _chat(long_id, max_tokens=3), headers=_principal("b")
        )
        assert b.status_code == 200
    finally:
        for s in a:
            s.close()


def test_principal_headers_without_the_key_claim_nothing(gated_node, long_id):
    for forged in (_principal("a", secret="wrong"), _principal("a", secret=None)):
        r = httpx.post(
            gated_node.v1 + "/chat/completions", json=_chat(long_id, max_tokens=3), headers=forged
        )
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_exchange_usage_needs_the_key_and_is_kept_for_keyed_requests(gated_node, long_id):
    headers = {**_principal("c"), EXCHANGE_HEADER: "gated-exchange-1"}
    body = _chat(long_id, max_tokens=3, ignore_eos=True)
    answer = gated_node.post("/v1/chat/completions", body, headers=headers)
    assert answer.status_code == 200
    path = exchange_usage_path("gated-exchange-1")
    assert httpx.get(gated_node.base_url + path, timeout=10).status_code == 401
    usage = gated_node.get(path).json()["usage"]
    assert usage["completion_tokens"] == answer.json()["usage"]["completion_tokens"] == 3


def test_the_metrics_token_lets_prometheus_scrape_and_opens_nothing_else(gated_node, long_id):
    def call(method: str, path: str, token: str | None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, gated_node.base_url + path, headers=headers, timeout=10, **kw)

    scrape = call("GET", "/metrics", "scrape-only")
    assert scrape.status_code == 200 and "helexa_requests_running" in scrape.text
    assert call("GET", "/metrics", "s3cret").status_code == 200  # the api_key still opens it
    for token in (None, "wrong"):
        assert call("GET", "/metrics", token).status_code == 401
    # the scrape token is not the api_key anywhere else: no models, no loads, no answers
    refused = [
        call("GET", "/v1/models", "scrape-only"),
        call("POST", "/models/load", "scrape-only", json={"model_id": long_id}),
        call("POST", "/models/unload", "scrape-only", json={"model_id": long_id}),
        call("POST", "/v1/chat/completions", "scrape-only", json=_chat(long_id, max_tokens=3)),
    ]
    for r in refused:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert long_id in [m["id"] for m in gated_node.get("/v1/models").json()["data"]]


# -- loading and unloading ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mgmt_node(tmp_path_factory, model_dirs):
    # a CPU node wherever the tests run: the refusals it is asked for (fp8) are the CPU's
    node = start_node(
        tmp_path_factory.mktemp("mgmt"), [model_dirs["long"]], engine={"device": "cpu"}
    )
    yield node
    node.stop()


def test_loading_and_unloading_a_model_leaves_another_models_stream_alone(
    mgmt_node, model_dirs, long_id
):
    other = str(model_dirs["tiny2"])
    stream = HeldStream(mgmt_node, _chat(long_id, max_tokens=400, ignore_eos=True))
    r = mgmt_node.post("/models/load", {"model_id": other})
    assert r.status_code == 200, r.text
    assert r.json()["model"]["status"] == "loaded"
    assert {m["id"] for m in mgmt_node.get("/models").json()} == {long_id, other}
    chat = mgmt_node.post("/v1/chat/completions", _chat(other, max_tokens=3))
    assert chat.status_code == 200
    assert mgmt_node.post("/models/unload", {"model_id": other}).status_code == 200
    assert mgmt_node.post("/v1/chat/completions", _chat(other)).status_code == 404
    stream._thread.join(60)
    assert stream.status == 200
    assert stream.lines[-1] == "data: [DONE]"
    finish = json.loads(
        next(x for x in reversed(stream.lines) if '"finish_reason":"length"' in x)[6:]
    )
    assert finish["usage"]["completion_tokens"] == 400


def test_concurrent_loads_of_one_model_load_it_once(mgmt_node, model_dirs):
    other = str(model_dirs["tiny2"])
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: mgmt_node.post("/models/load", {"model_id": other}), range(4))
        )
    assert all(r.status_code == 200 for r in results)
    assert mgmt_node.log().count(f"loading model {other}") == 2  # once here, once earlier
    mgmt_node.post("/models/unload", {"model_id": other})


def test_an_impossible_load_is_a_422_naming_the_problem(mgmt_node, tmp_path, model_dirs):
    missing = mgmt_node.post("/models/load", {"model_id": str(tmp_path / "nothing")})
    assert missing.status_code == 422
    assert missing.json()["error"]["kind"] == "model_not_found"
    bad_quant = mgmt_node.post("/models/load", {"model_id": "org/x-GGUF", "quant": "Q8_O"})
    err = bad_quant.json()["error"]
    assert bad_quant.status_code == 422 and err["kind"] == "invalid_quant"
    assert "Q8_0" in err["suggestion"] and err["model_id"] == "org/x-GGUF"
    odd = mgmt_node.post(
        "/models/load", {"model_id": str(model_dirs["tiny2"]), "tensor_parallel": 3}
    )
    assert odd.status_code == 422 and odd.json()["error"]["kind"] == "invalid_placement"
    # fp8 has kernels on CUDA only: a CPU node refuses it rather than widening to float
    fp8 = mgmt_node.post("/models/load", {"model_id": str(model_dirs["tiny2"]), "quant": "fp8"})
    assert fp8.status_code == 422 and fp8.json()["error"]["kind"] == "unsupported_quant"
    assert "CUDA" in fp8.json()["error"]["message"]
    typed = mgmt_node.post("/models/load", {"model_id": 5})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "model_id"
    assert mgmt_node.post("/models/unload", {"model_id": "never/loaded"}).status_code == 404


# -- faults -------------------------------------------------------------------------------


def test_an_injected_device_fault_poisons_then_the_model_recovers_by_itself(tmp_path, model_dirs):
    scripted = str(model_dirs["scripted"])
    node = start_node(tmp_path, [scripted], env={"HELEXA_DEBUG_POISON": scripted})
    try:
        r = node.post("/v1/chat/completions", _chat(scripted))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "model_recovering"
        assert "Retry-After" in r.headers
        _wait_for(lambda: node.post("/v1/chat/completions", _chat(scripted)).status_code == 200)
        assert "poisoned" in node.log() and "recovered" in node.log()
    finally:
        node.stop()


# -- shutdown -----------------------------------------------------------------------------


def test_sigterm_lets_the_running_stream_finish_then_exits_zero(tmp_path, model_dirs):
    long_id = str(model_dirs["long"])
    node = start_node(tmp_path, [long_id])
    stream = HeldStream(node, _chat(long_id, max_tokens=300, ignore_eos=True))
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0
    stream._thread.join(10)
    assert stream.lines[-1] == "data: [DONE]"
    usage = [json.loads(x[6:])["usage"] for x in stream.lines if '"usage"' in x]
    assert usage and usage[-1]["completion_tokens"] == 300
    log = node.log()
    assert "draining" in log and "all models unloaded" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(node.base_url + "/health", timeout=2)
