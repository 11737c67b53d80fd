"""Real opencode requests (shared/fixtures/traffic/opencode) replay through a node process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import FIXTURES_DIR
from tests.web.conftest import SCRIPT

CAPTURES = sorted((FIXTURES_DIR / "traffic" / "opencode").glob("*.json"))
# Hop-by-hop and body-describing headers are the transport's business, not the replay's.
_DROP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


@pytest.mark.skipif(not CAPTURES, reason="no opencode traffic fixtures")
@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
def test_an_opencode_request_is_answered_as_it_was_sent(node, scripted_id, capture: Path):
    record = json.loads(capture.read_text())
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
