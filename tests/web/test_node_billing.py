"""Every token the node generates is told to whoever bills it: in errors that came after the
model ran, and by exchange id (`x-helexa-exchange`) once a request has ended, however it
ended. Against a real node process."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from helexa.protocol.wire import EXCHANGE_HEADER, exchange_usage_path
from tests.web.node_proc import start_node, tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
FUNCTIONS = [{"type": "function", **TOOLS[0]["function"]}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
LONG = {"max_tokens": 8000, "ignore_eos": True}


def _exchange() -> tuple[str, dict[str, str]]:
    exchange_id = "ex_" + uuid.uuid4().hex
    return exchange_id, {EXCHANGE_HEADER: exchange_id}


def _final_usage(node, exchange_id: str, wait_s: float = 5) -> httpx.Response:
    return node.get(exchange_usage_path(exchange_id), params={"wait_s": wait_s})


def _sse(node, path: str, body: dict, **kw) -> list[dict]:
    with httpx.stream("POST", node.base_url + path, json=body, timeout=60, **kw) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _spent(usage: dict) -> tuple[int, int, int]:
    """Chat usage less its prefix-cache hits, which differ between two runs of a prompt."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def _in_flight(node, model: str) -> int:
    return next(m for m in node.get("/health").json()["models"] if m["id"] == model)["in_flight"]


def _until_idle(node, model: str, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while _in_flight(node, model) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_flight(node, model) == 0


def _metric(node, name: str, model: str) -> float:
    """One model's sample of `name` in the node's /metrics (0 before its first)."""
    prefix = f'{name}{{model="{model}"}} '
    for line in node.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def _generated(node, model: str) -> int:
    return int(_metric(node, "helexa_generation_tokens_total", model))


# -- usage in errors ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def answered(node, scripted_id) -> dict:
    """The usage of the scripted answer, asked for with tools and tool_choice left to the
    model: what the refused requests below generate too."""
    models = {m["id"]: m for m in node.get("/models").json()}
    assert models[scripted_id]["tool_call"] is False  # no markers: never a call
    body = {"model": scripted_id, "messages": ASK, "tools": TOOLS}
    usage = node.post("/v1/chat/completions", body).json()["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["prompt_tokens"] == node.post("/tokenize", body).json()["count"]
    return usage


def test_a_refused_tool_choice_still_reports_the_tokens_the_model_generated(
    node, scripted_id, answered
):
    body = {"model": scripted_id, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    r = node.post("/v1/chat/completions", body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "tool_choice_not_satisfied"
    assert _spent(error["usage"]) == _spent(answered)
    assert error["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert error["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_a_refused_tool_choice_on_a_stream_reports_its_usage_in_the_error_event(
    node, scripted_id, answered
):
    body = {
        "model": scripted_id,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "stream": True,
    }
    error = _sse(node, "/v1/chat/completions", body)[-1]["error"]
    assert error["code"] == "tool_choice_not_satisfied"
    assert _spent(error["usage"]) == _spent(answered)
    assert error["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert error["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_a_refused_tool_choice_on_the_responses_api_reports_its_usage_in_that_apis_shape(
    node, scripted_id, answered
):
    body = {"model": scripted_id, "input": ASK, "tools": FUNCTIONS, "tool_choice": "required"}
    r = node.post("/v1/responses", body)
    assert r.status_code == 422, r.text
    usage = r.json()["error"]["usage"]
    assert usage["output_tokens"] == answered["completion_tokens"]
    assert usage["input_tokens"] == answered["prompt_tokens"]
    assert usage["total_tokens"] == answered["total_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    failed = _sse(node, "/v1/responses", {**body, "stream": True})[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["usage"]["output_tokens"] == answered["completion_tokens"]
    assert failed["response"]["usage"]["output_tokens"] == answered["completion_tokens"]


def test_an_error_before_the_model_ran_carries_no_usage(node, tiny_id):
    body = {"model": tiny_id, "messages": [{"role": "user", "content": "word " * 400}]}
    r = node.post("/v1/chat/completions", body)
    assert r.status_code == 400
    assert "usage" not in r.json()["error"]


def test_a_model_unloaded_mid_stream_ends_it_with_an_error_that_reports_what_was_generated(
    node, tmp_path
):
    model = str(tiny_model(tmp_path, "smollm2", max_position_embeddings=8192, vocab_size=49152))
    assert node.post("/models/load", {"model_id": model}).status_code == 200
    exchange_id, headers = _exchange()
    body = {"model": model, "prompt": "Once upon a time", "stream": True, **LONG}
    url = node.v1 + "/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        events, lines = [], r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                assert node.post("/models/unload", {"model_id": model}).status_code == 200
                break
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    events += [json.loads(line) for line in rest if line != "[DONE]"]
    error = events[-1]["error"]
    assert error["code"] == "service_unavailable"
    assert error["usage"]["completion_tokens"] >= len(events) - 1
    final = _final_usage(node, exchange_id).json()["usage"]
    assert final["completion_tokens"] == error["usage"]["completion_tokens"]


# -- final usage by exchange ----------------------------------------------------------------


def test_a_finished_exchange_reports_the_usage_its_answer_gave(node, scripted_id):
    exchange_id, headers = _exchange()
    body = {"model": scripted_id, "messages": ASK}
    usage = node.post("/v1/chat/completions", body, headers=headers).json()["usage"]
    r = _final_usage(node, exchange_id, wait_s=0)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "exchange": exchange_id,
        "usage": {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": usage["prompt_tokens_details"]["cache_write_tokens"],
            "reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"],
        },
    }


def test_a_stream_the_client_left_reports_every_token_the_engine_generated(node, long_id):
    _until_idle(node, long_id)
    generated = _generated(node, long_id)
    exchange_id, headers = _exchange()
    body = {"model": long_id, "messages": ASK, "stream": True, **LONG}
    url = node.v1 + "/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        contents = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                contents += bool(delta.get("content"))
            if contents == 5:
                running = _final_usage(node, exchange_id, wait_s=0)
                assert running.status_code == 409
                assert running.json()["error"]["code"] == "exchange_running"
                break  # leave mid-stream
    r = _final_usage(node, exchange_id)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert 5 <= usage["completion_tokens"] < 8000
    # the engine's last step before the abort included (its report on the abort closes it)
    assert _generated(node, long_id) - generated == usage["completion_tokens"]
    full = node.post("/v1/chat/completions", {**body, "stream": False, "max_tokens": 1})
    assert usage["prompt_tokens"] == full.json()["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    _until_idle(node, long_id)


def test_a_client_that_leaves_a_non_streaming_request_stops_it_and_its_usage_is_kept(node, long_id):
    _until_idle(node, long_id)
    generated = _generated(node, long_id)
    exchange_id, headers = _exchange()
    body = {"model": long_id, "messages": ASK, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(node.v1 + "/chat/completions", json=body, headers=headers, timeout=1.0)
    _until_idle(node, long_id, timeout_s=3)
    r = _final_usage(node, exchange_id)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert 0 < usage["completion_tokens"] < 2000
    assert _generated(node, long_id) - generated == usage["completion_tokens"]


def test_an_ask_about_a_running_exchange_waits_for_it_to_end(node, long_id):
    exchange_id, headers = _exchange()
    body = {"model": long_id, "messages": ASK, "max_tokens": 600, "ignore_eos": True}
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            node.post("/v1/chat/completions", body, headers=headers).json()
        )
    )
    thread.start()
    deadline = time.monotonic() + 10
    while (seen := _final_usage(node, exchange_id, wait_s=0)).status_code == 404:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert seen.status_code == 409  # 600 tokens take a while
    r = _final_usage(node, exchange_id, wait_s=10)
    thread.join()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"] == 600


def test_a_request_refused_before_running_ends_its_exchange_with_nothing_spent(node, tiny_id):
    exchange_id, headers = _exchange()
    body = {"model": tiny_id, "messages": [{"role": "user", "content": "word " * 400}]}
    assert node.post("/v1/chat/completions", body, headers=headers).status_code == 400
    usage = _final_usage(node, exchange_id, wait_s=0).json()["usage"]
    assert usage == dict.fromkeys(
        (
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "cached_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
        ),
        0,
    )
    bad = node.post("/v1/chat/completions", {"model": tiny_id}, headers=headers)
    assert bad.status_code == 400
    assert _final_usage(node, exchange_id, wait_s=0).json()["usage"]["total_tokens"] == 0


def test_unknown_and_malformed_exchange_ids_are_404_and_400(node, scripted_id):
    r = _final_usage(node, "never-seen", wait_s=0)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "exchange_not_found"
    assert _final_usage(node, "x" * 65, wait_s=0).status_code == 400
    assert _final_usage(node, "bad.id", wait_s=0).status_code == 400
    assert _final_usage(node, "never-seen", wait_s="soon").status_code == 400
    bad_header = {EXCHANGE_HEADER: "not valid!"}
    body = {"model": scripted_id, "messages": ASK}
    r = node.post("/v1/chat/completions", body, headers=bad_header)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == EXCHANGE_HEADER


# -- a prompt cut during its prefill --------------------------------------------------------

CHUNK = 8  # the prefill node's max_prefill_chunk: a long prompt takes hundreds of steps


@pytest.fixture(scope="module")
def prefill_node(tmp_path_factory, model_dirs):
    """The long model prefilling 8 tokens a step, and nothing beside: a 6000-token prompt
    prefills for hundreds of steps, while any other request waits in the engine's queue."""
    proc = start_node(
        tmp_path_factory.mktemp("prefill"),
        [model_dirs["long"]],
        engine={"max_prefill_chunk": CHUNK, "max_num_batched_tokens": CHUNK, "max_num_seqs": 4},
    )
    yield proc
    proc.stop()


def _leave_during_prefill(
    node, model: str, path: str, body: dict, headers: dict, until: str = "running"
) -> None:
    """Send a request on a raw connection and close it once the engine has a sequence
    `until` (running: its prefill has begun, no token came back yet; waiting: it waits in
    the engine's queue)."""
    url = urlsplit(node.base_url)
    payload = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {url.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((url.hostname, url.port)) as conn:
        conn.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 10
        while _metric(node, f"helexa_requests_{until}", model) < 1:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.002)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_prompt_cut_during_its_prefill_reports_the_prompt_tokens_the_engine_computed(
    prefill_node, long_id, stream
):
    node = prefill_node
    _until_idle(node, long_id)
    generated = _generated(node, long_id)
    exchange_id, headers = _exchange()
    prompt = random.Random(f"{stream}-{exchange_id}").choices(range(1000, 40000), k=6000)
    body = {"model": long_id, "prompt": prompt, "max_tokens": 4, "stream": stream}
    _leave_during_prefill(node, long_id, "/v1/completions", body, headers)
    r = _final_usage(node, exchange_id)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 0
    assert 0 < usage["prompt_tokens"] < len(prompt), usage  # cut part-way, billed so far
    assert usage["prompt_tokens"] % CHUNK == 0
    assert usage["total_tokens"] == usage["prompt_tokens"]
    assert usage["cached_tokens"] == 0  # a prompt no one sent before
    assert _generated(node, long_id) == generated
    _until_idle(node, long_id)


def test_a_request_that_waited_behind_another_and_left_before_it_ran_spent_nothing(
    prefill_node, long_id
):
    """A request the engine never scheduled (it waited for a place in the batch) is 0."""
    node = prefill_node
    _until_idle(node, long_id)
    first_id, first = _exchange()
    second_id, second = _exchange()
    prompt = random.Random(first_id).choices(range(1000, 40000), k=6000)
    body = {"model": long_id, "prompt": prompt, "max_tokens": 1, "stream": True}
    url = node.v1 + "/completions"
    with httpx.stream("POST", url, json=body, headers=first, timeout=60):
        # the first fills every step's budget: the second waits in the engine's queue
        again = {**body, "prompt": prompt[::-1]}
        _leave_during_prefill(node, long_id, "/v1/completions", again, second, until="waiting")
    waited = _final_usage(node, second_id).json()["usage"]
    assert waited["total_tokens"] == 0, waited
    assert _final_usage(node, first_id).json()["usage"]["prompt_tokens"] > 0
    _until_idle(node, long_id)
