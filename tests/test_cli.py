"""The `helexa` command line."""

from __future__ import annotations

import subprocess
import sys


def helexa(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "helexa.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_help_lists_the_commands():
    done = helexa("--help")
    assert done.returncode == 0
    for cmd in ("chat", "bench", "config"):
        assert cmd in done.stdout


def test_a_bad_config_file_is_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "helexa.toml"
    bad.write_text("[engine]\nblok_size = 16\n")
    done = helexa("config", "--config", str(bad))
    assert done.returncode == 2
    assert "did you mean 'block_size'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_model_is_a_clear_error(tmp_path):
    done = helexa("chat", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert done.returncode == 1
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
