"""llama.cpp as `helexa bench engine`'s reference: llama-bench's JSON (a real run's output,
trimmed, in llama_bench_output.json) read into the engine bench's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helexa.bench import llama_cpp

OUTPUT = Path(__file__).with_name("llama_bench_output.json")


def test_prompt_rates_become_ttft_and_the_generation_rate_batch_1_decode():
    tests = json.loads(OUTPUT.read_text())
    bench = llama_cpp.parse(OUTPUT.read_text(), new_tokens=128)
    assert bench.build == "b1 (0c1e570)"
    pp1024 = next(t for t in tests if t["n_prompt"] == 1024)
    assert bench.figures["ttft@1024"] == pytest.approx(1024 / pp1024["avg_ts"])
    assert bench.figures["decode@1"] == pytest.approx(
        next(t["avg_ts"] for t in tests if t["n_gen"] == 128)
    )
    assert set(bench.figures) == {"ttft@128", "ttft@1024", "decode@1"}
    # a generation run of another length is not batch-1 decode of this bench's length
    assert "decode@1" not in llama_cpp.parse(OUTPUT.read_text(), new_tokens=64).figures


def test_generation_is_read_at_the_engines_depth_and_from_an_empty_context():
    # a real run of `-p 128 -n 128 -d 0,64`: every test at depths 0 and 64
    text = OUTPUT.with_name("llama_bench_output_depth.json").read_text()
    tests = json.loads(text)
    bench = llama_cpp.parse(text, new_tokens=128, depth=64)

    def rate(n_prompt: int, n_gen: int, depth: int) -> float:
        return next(
            t["avg_ts"]
            for t in tests
            if (t["n_prompt"], t["n_gen"], t["n_depth"]) == (n_prompt, n_gen, depth)
        )

    assert bench.figures["decode@1"] == pytest.approx(rate(0, 128, 64))
    assert bench.figures["decode@1/d0"] == pytest.approx(rate(0, 128, 0))
    assert bench.figures["ttft@128"] == pytest.approx(128 / rate(128, 0, 0))  # not after 64
    assert set(bench.figures) == {"ttft@128", "decode@1", "decode@1/d0"}


def test_the_command_asks_for_the_same_file_threads_and_lengths():
    cmd = llama_cpp.command("llama-bench", "m.gguf", 2, [128, 1024], 128, 3)
    assert cmd == ["llama-bench", "-m", "m.gguf", "-t", "2", "-p", "128,1024", "-n", "128",
                   "-r", "3", "-o", "json"]  # fmt: skip
    cmd = llama_cpp.command("llama-bench", "m.gguf", 2, [128], 128, 3, depth=64)
    assert cmd[cmd.index("-d") + 1] == "0,64"


def test_a_missing_or_failing_llama_bench_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such executable"):
        llama_cpp.find(str(tmp_path / "llama-bench"))
    failing = tmp_path / "llama-bench"
    failing.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    failing.chmod(0o755)
    assert llama_cpp.find(str(failing)) == str(failing)
    with pytest.raises(ValueError, match="exited 1: error: failed to load model"):
        llama_cpp.run(str(failing), "m.gguf", 2, [128], 16, 1)
    with pytest.raises(ValueError, match="printed no tests"):
        llama_cpp.parse("[]", 128)


def test_on_the_gpu_every_layer_is_offloaded_with_flash_attention_instead_of_threads():
    cmd = llama_cpp.command("llama-bench", "m.gguf", None, [512, 8192], 128, 3)
    assert cmd == ["llama-bench", "-m", "m.gguf", "-ngl", "99", "-fa", "1", "-p", "512,8192",
                   "-n", "128", "-r", "3", "-o", "json"]  # fmt: skip
    assert "-t" not in cmd


def test_the_engine_table_gives_helexas_speed_over_llama_cpps_for_each_figure():
    from types import SimpleNamespace

    from helexa.bench.engine import DecodeRun, SideResult, format_table, speed_ratio

    ours = SideResult("helexa", ttft_s={128: [0.5]})
    ours.decode[1] = DecodeRun(1, 11, 0.1, 1.0, 1.1, 10)  # 10 tok/s
    llama = llama_cpp.LlamaBench("b1 (x)", {"ttft@128": 0.25, "decode@1": 40.0})
    args = SimpleNamespace(prompt_lengths=[128], concurrency=[1])
    lines = format_table([ours], args, llama).splitlines()
    assert lines[0] == (
        "| figure | helexa | llama.cpp b1 (x) | helexa / llama.cpp (speed) | rest of machine (CPUs) |"
    )
    assert lines[2] == "| TTFT, 128-token prompt (s) | 0.50 | 0.25 | 0.50x | 0.00 |"
    assert lines[3] == "| decode, batch 1 (tok/s) | 10.0 | 40.0 | 0.25x | 0.00 |"
    assert speed_ratio(None, 1.0, "tok/s") == "–"
