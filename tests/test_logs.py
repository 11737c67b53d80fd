"""Structured log events: readable as text, fields as keys in JSON."""

from __future__ import annotations

import json
import logging

from helexa.logs import JsonFormatter, event


def test_an_event_reads_as_text_and_carries_its_fields_as_json_keys(caplog):
    log = logging.getLogger("helexa.test")
    with caplog.at_level(logging.WARNING, logger="helexa.test"):
        event(log, logging.WARNING, "upstream error", node="a", status=503)
    record = caplog.records[-1]
    assert record.getMessage() == "upstream error node='a' status=503"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["node"] == "a" and entry["status"] == 503
    assert entry["level"] == "warning" and entry["msg"].startswith("upstream error")
