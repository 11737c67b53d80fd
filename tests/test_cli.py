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


def test_bench_engine_prints_its_table(tmp_path):
    from tests.engine.tiny import make_tiny_model
    from tests.shared_fixtures import need_shared

    need_shared()
    model_dir, _ = make_tiny_model("llama3", tmp_path)
    args = "--skip-hf --prompt-lengths 8 --concurrency 2 --decode-tokens 4 --repeats 1"
    args += f" --kv-cache-mb 8 --model {model_dir} --json {tmp_path / 'out.json'}"
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "bench", "engine", *args.split()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| decode, batch 1 (tok/s) |" in done.stdout
    assert (tmp_path / "out.json").exists()


def test_commands_that_need_no_model_never_import_torch(tmp_path):
    # the gateway, keys, spend and db commands: torch costs seconds and memory per process
    config = tmp_path / "helexa.toml"
    config.write_text(f'[gateway]\ndatabase_url = "sqlite:///{tmp_path / "h.db"}"\n')
    probe = (
        "import sys, runpy; sys.argv = ['helexa', 'keys', 'list', '--config', sys.argv[1]]\n"
        "import helexa.web.gateway_app\n"
        "try:\n    runpy.run_module('helexa.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
    assert helexa("bench", "engine", "--help").returncode == 0  # bench commands load theirs


def test_a_bench_suite_imports_its_own_module_alone():
    # `helexa bench gpu` on a GPU host: no database (bench run's history), no HTTP clients
    probe = (
        "import sys; from helexa.cli import build_parser, _bench_suite\n"
        "build_parser(with_bench=_bench_suite(['bench', 'gpu', '--quick']))\n"
        "print(sorted(m for m in ('helexa.bench.gpu', 'helexa.bench.history', "
        "'helexa.bench.node', 'sqlalchemy') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['helexa.bench.gpu']"]
    from helexa.cli import _bench_suite

    assert _bench_suite(["bench", "--help"]) is True and _bench_suite(["serve"]) is False
