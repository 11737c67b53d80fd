"""Reading an Anthropic event stream off the wire, and what makes one well formed."""

from __future__ import annotations

import json
from collections.abc import Iterable

import httpx

_DELTAS = {
    "text": {"text_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "tool_use": {"input_json_delta"},
}


def parse_events(lines: Iterable[str]) -> list[tuple[str, dict]]:
    """`event:`/`data:` pairs, in order (every data line must be JSON)."""
    events, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def stream_events(
    base_url: str, body: dict, headers: dict | None = None, path: str = "/v1/messages"
) -> list[tuple[str, dict]]:
    with httpx.stream(
        "POST", base_url + path, json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_events(r.iter_lines())


def assert_well_formed(events: list[tuple[str, dict]]) -> dict:
    """The event grammar: message_start, then blocks indexed 0.. each opened, given deltas of
    its kind and closed in turn, then message_delta and message_stop (pings anywhere).
    Returns the message the events build."""
    events = [e for e in events if e[0] != "ping"]
    assert events[0][0] == "message_start", events[:2]
    message = dict(events[0][1]["message"], content=[])
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_")
    assert [name for name, _ in events[-2:]] == ["message_delta", "message_stop"], events[-3:]
    open_block, partial = None, ""
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == len(message["content"])
            open_block = dict(data["content_block"])
            partial = ""
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == len(message["content"])
            delta = data["delta"]
            assert delta["type"] in _DELTAS[open_block["type"]], (open_block, delta)
            if delta["type"] == "text_delta":
                open_block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                open_block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                open_block["signature"] = delta["signature"]
            else:
                partial += delta["partial_json"]
        else:
            assert name == "content_block_stop", name
            assert open_block is not None and data["index"] == len(message["content"])
            if open_block["type"] == "tool_use":
                open_block["input"] = json.loads(partial) if partial else {}
            if open_block["type"] == "thinking":
                assert open_block["signature"], "a thinking block is signed before it stops"
            message["content"].append(open_block)
            open_block = None
    assert open_block is None
    assert message["content"], "at least one block"
    final = events[-2][1]
    message.update(final["delta"])
    message["usage"] = {**message["usage"], **final["usage"]}
    assert message["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    return message
