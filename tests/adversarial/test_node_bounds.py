"""Requests built to exhaust a node: each bound answers a 400 naming its field before any
tokenizing, an oversized body a 413, and the node serves the next caller as before."""

from __future__ import annotations

import httpx
import pytest

from tests.web.node_proc import start_node

MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def bounded(tmp_path_factory, scripted_id):
    node = start_node(
        tmp_path_factory.mktemp("bounds"), [scripted_id], env={"HELEXA_HTTP_MAX_BODY_MB": "16"}
    )
    yield node
    node.stop()


CASES = [
    ("stop", {"stop": ["a"] * 17}),
    ("stop[1]", {"stop": ["ok", "x" * 513]}),
    ("stop_token_ids", {"stop_token_ids": list(range(65))}),
    ("logit_bias", {"logit_bias": {str(i): 1 for i in range(301)}}),
    ("logit_bias.7", {"logit_bias": {"7": 101}}),
    ("n", {"n": 16, "max_tokens": 9000}),
    ("max_tokens", {"max_tokens": 200_000}),
    ("top_logprobs", {"n": 8, "logprobs": True, "top_logprobs": 20}),
    ("messages", {"messages": MSG * 10_001}),
]


@pytest.mark.parametrize("field,extra", CASES, ids=[c[0] for c in CASES])
def test_each_bound_is_a_400_naming_its_field(bounded, scripted_id, field, extra):
    body = {"model": scripted_id, "messages": MSG, **extra}
    r = bounded.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert error["type"] == "invalid_request_error"


def test_a_streamed_answer_may_buffer_more_than_a_whole_one(bounded, scripted_id):
    body = {"model": scripted_id, "messages": MSG, "n": 16, "max_tokens": 9000, "stream": True}
    with httpx.stream("POST", bounded.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert any(line == "data: [DONE]" for line in r.iter_lines())


def test_completions_are_bounded_too(bounded, scripted_id):
    r = bounded.post("/v1/completions", {"model": scripted_id, "prompt": "Hi", "stop": ["y" * 600]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop[0]"
    r = bounded.post(
        "/v1/completions", {"model": scripted_id, "prompt": "Hi", "logprobs": 20, "n": 8}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_huge_prompt_is_refused_before_it_is_tokenized(bounded, scripted_id):
    huge = "word " * 1_700_000  # 8.5 M characters: past the bound, under the body limit
    r = bounded.post(
        "/v1/chat/completions",
        {"model": scripted_id, "messages": [{"role": "user", "content": huge}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # the character bound answered, not the context check that needs the tokens
    assert "8000000 characters" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413(bounded, scripted_id):
    big = "x" * (17 << 20)
    r = bounded.post(
        "/v1/chat/completions",
        {"model": scripted_id, "messages": [{"role": "user", "content": big}]},
    )
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error"
    ok = bounded.post("/v1/chat/completions", {"model": scripted_id, "messages": MSG})
    assert ok.status_code == 200
