"""Real opencode requests (shared/fixtures/traffic/opencode) replay through a node process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.shared_fixtures import captures, need_shared
from tests.web.conftest import REASONING, SCRIPT

CAPTURES = captures("opencode")
# Hop-by-hop and body-describing headers are the transport's business, not the replay's.
_DROP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
def test_an_opencode_request_is_answered_as_it_was_sent(node, scripted_id, capture: Path):
    record = json.loads(need_shared(capture).read_text())
    body = {**record["body"], "model": scripted_id}
    headers = {k: v for k, v in record["headers"].items() if k.lower() not in _DROP}
    url = node.base_url + record["path"]
    if not body.get("stream"):
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == SCRIPT
        return
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == SCRIPT
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("answer", ["think", "calls"])
@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
def test_an_opencode_request_renders_through_qwen3_and_gets_parsed_answers(
    agent_node, agent_models, capture: Path, answer: str
):
    """The same traffic against the real Qwen3 template, with answers that reason or call
    tools: tools and earlier tool turns render, and what comes back is structured."""
    record = json.loads(need_shared(capture).read_text())
    body = {**record["body"], "model": agent_models[answer], "stream": True}
    headers = {k: v for k, v in record["headers"].items() if k.lower() not in _DROP}
    url = agent_node.base_url + record["path"]
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1] if e]
    assert all("error" not in c for c in chunks), chunks[-1]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    if answer == "calls" and body.get("tools"):
        calls = [t for d in deltas for t in d.get("tool_calls", [])]
        assert len(calls) == 2 and finish == "tool_calls"
        assert "<tool_call>" not in content
    else:
        assert finish == "stop"
    if answer == "think":
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        assert content == "The answer is 4." and "<think>" not in content
        assert reasoning == f"\n{REASONING}\n"  # a model that thinks anyway never leaks
        # reasoning_effort turns thinking on in the template; without it, it is off
        wanted = bool(body.get("reasoning_effort")) and body["reasoning_effort"] != "none"
        explicit = {**body, "chat_template_kwargs": {"enable_thinking": wanted}}
        tokenized = [agent_node.post("/tokenize", b).json()["count"] for b in (body, explicit)]
        assert tokenized[0] == tokenized[1]
