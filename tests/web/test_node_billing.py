"""Every token the node generates is told to whoever bills it, in errors that came after the
model ran too. Against a real node process."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.web.node_proc import tiny_model

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


def _sse(node, path: str, body: dict, **kw) -> list[dict]:
    with httpx.stream("POST", node.base_url + path, json=body, timeout=60, **kw) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _spent(usage: dict) -> tuple[int, int, int]:
    """Chat usage less its prefix-cache hits, which differ between two runs of a prompt."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


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
    body = {"model": model, "prompt": "Once upon a time", "stream": True, **LONG}
    url = node.v1 + "/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
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
