"""Real Claude Code requests (shared/fixtures/traffic/claude-code) replay through a real
gateway to a real node, as they were sent: path with `?beta=true`, every header, body."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.gateway.anthropic_events import assert_well_formed, parse_events
from tests.gateway.gateway_proc import start_gateway
from tests.shared_fixtures import captures, need_shared
from tests.web.conftest import SCRIPT
from tests.web.node_proc import start_node

CAPTURES = captures("claude-code")
COUNTS = [c for c in CAPTURES if "count-tokens" in c.name]
# Hop-by-hop and body-describing headers are the transport's business, not the replay's.
_DROP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("cc-traffic")
    node = start_node(tmp / "node", [model_dirs["scripted"]])
    scripted = str(model_dirs["scripted"])
    # the names Claude Code asked for are aliases of the scripted model
    aliases = {"helexa/test": scripted, "claude-opus-4-8": scripted}
    gw = start_gateway(tmp, {"n": node}, aliases=aliases)
    yield gw
    gw.stop()
    node.stop()


def _replay(gw, record: dict) -> httpx.Response | list[tuple[str, dict]]:
    headers = {k: v for k, v in record["headers"].items() if k.lower() not in _DROP}
    url = gw.base_url + record["raw_path"]
    body = record["body"]
    if (body.get("output_config") or {}).get("format"):
        # the scripted model, held to a schema it does not speak, would fill all 64000
        body = {**body, "max_tokens": min(body.get("max_tokens", 1024), 1024)}
    if not body.get("stream"):
        return httpx.post(url, json=body, headers=headers, timeout=120)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_events(r.iter_lines())


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
def test_a_claude_code_request_is_answered_as_it_was_sent(gw, capture: Path):
    record = json.loads(need_shared(capture).read_text())
    assert "?beta=true" in record["raw_path"]
    answer = _replay(gw, record)
    if "count_tokens" in record["path"]:
        assert answer.status_code == 200, answer.text
        assert answer.json()["input_tokens"] > 0
        return
    message = assert_well_formed(answer)
    assert [b["type"] for b in message["content"]] == ["text"]
    if (record["body"].get("output_config") or {}).get("format"):
        # structured output: the scripted model is held to the schema's JSON
        if message["stop_reason"] == "end_turn":
            json.loads(message["content"][0]["text"])
        else:
            assert message["stop_reason"] == "max_tokens"
    else:
        assert message["content"][0]["text"] == SCRIPT
        assert message["stop_reason"] == "end_turn"
    assert message["model"] == record["body"]["model"]
    usage = message["usage"]
    # the system prompt and tools counted, in full, from the node's prefix cache or into it
    prompt = sum(
        usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )
    assert prompt > (2000 if record["body"].get("tools") else 100)
    assert message["usage"]["output_tokens"] > 0


def test_the_fourteen_parallel_count_tokens_calls_of_slash_context_all_answer(gw):
    records = [json.loads(need_shared(c).read_text()) for c in COUNTS or CAPTURES]
    with ThreadPoolExecutor(len(records)) as pool:
        answers = list(pool.map(lambda r: _replay(gw, r), records))
    assert [a.status_code for a in answers] == [200] * len(records)
    counts = [a.json()["input_tokens"] for a in answers]
    # a longer prompt, more tokens: the counts are the node's, not a constant
    sizes = [len(json.dumps(r["body"]["messages"])) for r in records]
    by_size = sorted(zip(sizes, counts, strict=True))
    assert by_size[0][1] < by_size[-1][1]


def test_head_before_a_session_is_answered(gw):
    r = httpx.head(gw.base_url + "/", headers={"User-Agent": "Bun/1.4.0"}, timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(gw.base_url + "/", timeout=10).json()["role"] == "gateway"
