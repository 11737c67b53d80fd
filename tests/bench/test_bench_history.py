"""Bench history on a real (SQLite) database at the migrations' head: which cells a run may
skip, the report's latest figures and changes per build, and the console's chart geometry.
(The harness against a real node, and the console in a browser: tests/web/test_admin_console.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from helexa.bench import history as bh
from helexa.bench.history import Build
from helexa.bench.scenarios import SCENARIOS, Target, pick_scenarios, quick
from helexa.web.admin_bench import scenario_views

OLD, NEW = Build("a" * 40, False), Build("b" * 40, False)
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def add(sessions, build: Build, scenario: str, minutes: int, target="gpu1", model="m", **m):
    run = bh.start_run(
        sessions,
        target=target,
        target_url="http://x/v1",
        build=build,
        build_info=None,
        host="h",
        quick=False,
    )
    values = {
        "concurrency": 1,
        "requests": 1,
        "prompt_tokens": 128,
        "completion_tokens": 256,
        "wall_s": 1.0,
        **m,
    }
    bh.record_sample(
        sessions,
        run,
        ts=T0 + timedelta(minutes=minutes),
        target=target,
        sha=build.sha,
        dirty=build.dirty,
        model=model,
        scenario=scenario,
        **values,
    )


def test_a_cell_counts_samples_per_target_build_model_and_scenario(sessions):
    add(sessions, OLD, "chat-128", 0, ttft_ms=10.0)
    add(sessions, OLD, "chat-128", 1, ttft_ms=11.0)
    add(sessions, Build(OLD.sha, True), "chat-128", 2, ttft_ms=12.0)  # a dirty tree: its own
    add(sessions, OLD, "chat-128", 3, target="gpu2", ttft_ms=12.0)
    assert bh.samples_taken(sessions, "gpu1", OLD, "m", "chat-128") == 2
    assert bh.samples_taken(sessions, "gpu1", Build(OLD.sha, True), "m", "chat-128") == 1
    assert bh.samples_taken(sessions, "gpu1", NEW, "m", "chat-128") == 0
    assert bh.samples_taken(sessions, "gpu1", OLD, "m", "chat-4096") == 0
    assert bh.samples_taken(sessions, "gpu1", OLD, "other", "chat-128") == 0


def test_the_report_shows_each_cells_latest_build_and_its_change_from_the_one_before(sessions):
    for i, rate in enumerate([100.0, 110.0, 120.0]):
        add(sessions, OLD, "throughput-c16", i, tok_s=rate, latency_ms=500.0)
    for i, rate in enumerate([90.0, 99.0]):
        add(sessions, NEW, "throughput-c16", 10 + i, tok_s=rate, latency_ms=400.0)
    add(sessions, OLD, "chat-4096", 20, ttft_ms=900.0, decode_tok_s=50.0)
    add(sessions, OLD, "chat-128", 21, ttft_ms=30.0, decode_tok_s=55.0)

    series = bh.history(sessions)
    assert [s.scenario for s in series] == ["chat-128", "chat-4096", "throughput-c16"]
    tp = series[2]
    assert [v.build for v in tp.versions] == [OLD, NEW]
    assert tp.latest.samples == 2 and tp.latest.medians["tok_s"] == pytest.approx(94.5)
    assert tp.change("tok_s") == pytest.approx(94.5 / 110 - 1)
    assert tp.change("latency_ms") == pytest.approx(-0.2)
    assert tp.change("ttft_ms") is None  # measured by neither build

    text = bh.report(series)
    lines = text.splitlines()
    assert lines[0].startswith("| target | model | scenario | build | samples | TTFT ms")
    row = next(line for line in lines if "throughput-c16" in line)
    assert f"`{'b' * 12}`" in row and "| 2 |" in row
    assert "94.5 (-14.1%)" in row and "400 (-20.0%)" in row and f"`{'a' * 12}`" in row
    chat = next(line for line in lines if "chat-4096" in line)
    assert "900 |" in chat and "50.0" in chat and chat.endswith("| – |")  # no build before
    assert bh.report(bh.history(sessions, target="nobody")).startswith("No bench samples yet")


def test_the_console_charts_a_line_per_target_and_model_across_builds(sessions):
    for i, build in enumerate([OLD, NEW]):
        add(sessions, build, "chat-128", i, ttft_ms=20.0 + 10 * i, decode_tok_s=60.0 - 10 * i)
    add(sessions, NEW, "chat-128", 5, target="gpu2", ttft_ms=50.0, decode_tok_s=40.0)
    (view,) = scenario_views(bh.history(sessions))
    assert view.name == "chat-128" and view.metrics == ["ttft_ms", "decode_tok_s"]
    ttft = view.charts[0]
    assert [line.name for line in ttft.lines] == ["gpu1 · m", "gpu2 · m"]
    gpu1, gpu2 = ttft.lines
    assert len(gpu1.dots) == 2 and len(gpu2.dots) == 1
    assert gpu1.dots[0].x < gpu1.dots[1].x == gpu2.dots[0].x  # builds in the order first seen
    assert gpu1.dots[0].y > gpu1.dots[1].y  # 20 ms sits lower than 30 ms
    assert f"at {'b' * 12}: TTFT ms 30.0" in gpu1.dots[1].label
    assert [t.label for t in ttft.ticks] == ["a" * 9, "b" * 9]
    assert view.rows[0].values["ttft_ms"] == ("30.0", "+50.0%") and view.rows[0].previous


def test_targets_parse_with_or_without_v1_and_scenarios_by_name():
    t = Target.parse("http://gpu1:13131/v1/", None)
    assert (t.name, t.root, t.v1) == ("gpu1:13131", "http://gpu1:13131", "http://gpu1:13131/v1")
    assert Target.parse("https://h/proxy", "x").v1 == "https://h/proxy/v1"
    with pytest.raises(ValueError, match="expected a base URL"):
        Target.parse("gpu1:13131", None)
    assert [s.name for s in pick_scenarios(None, False)] == list(SCENARIOS)
    picked = pick_scenarios(["chat-128,throughput-c4", "chat-128"], True)
    assert [s.name for s in picked] == ["chat-128-quick", "throughput-c4-quick"]
    assert picked[1] == quick(SCENARIOS["throughput-c4"]) and picked[1].requests == 4
    with pytest.raises(ValueError, match="unknown scenario chat-9; known: chat-128"):
        pick_scenarios(["chat-9"], False)
