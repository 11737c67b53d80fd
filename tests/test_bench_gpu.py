"""`helexa bench gpu`: the harness end to end on CPU (--quick), its refusal without CUDA,
and the presets' sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helexa.bench.gpu import NO_CUDA
from helexa.bench.random_models import PRESETS, param_counts

NUMBER = re.compile(r"\d+(\.\d+)?")
PERCENT = r"\d+(\.\d+)?%"


def bench_gpu(*args: str) -> subprocess.CompletedProcess:
    # one thread: tiny matmuls gain nothing from more, and lose much to a busy neighbour
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "helexa.cli", "bench", "gpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def table_rows(stdout: str) -> list[list[str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")][1:]  # less the header
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_quick_mode_on_cpu_prints_every_figure_as_a_number(tmp_path):
    out = tmp_path / "gpu.json"
    models = "tiny-dense,tiny-moe"
    done = bench_gpu(
        "--device", "cpu", "--quick", "--models", models, "--repeats", "1", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = table_rows(done.stdout)
    with_hf = importlib.util.find_spec("transformers") is not None
    seen = {(model, fmt) for model, fmt, *_ in rows}
    assert seen == {(m, f) for m in ("tiny-dense", "tiny-moe") for f in ("bf16", "q4_k")}
    figures = [r[2] for r in rows if r[:2] == ["tiny-dense", "bf16"]]
    assert figures[0] == "decode, batch 1 (tok/s)"
    assert [f for f in figures if f.startswith("TTFT")] == [
        f"TTFT, {n}-token prompt (ms)" for n in (32, 256, 1024)
    ]
    assert figures[-1].startswith("output tok/s, 8 seqs")  # the protocol: dense preset only
    assert not any(r[2].startswith("output tok/s") for r in rows if r[0] == "tiny-moe")
    for model, fmt, figure, ours, theirs, pct in rows:
        assert NUMBER.fullmatch(ours), (model, fmt, figure, ours)
        if fmt == "q4_k":
            assert theirs == "n/a"
        elif with_hf:
            assert NUMBER.fullmatch(theirs), (model, fmt, figure, theirs)
        if figure.startswith("decode"):
            hf_pct = "n/a" if fmt == "q4_k" else PERCENT
            assert re.fullmatch(f"{PERCENT} / {hf_pct}", pct), pct
    assert "copy bandwidth:" in done.stdout and "torch " in done.stdout
    assert "[tiny-moe q4_k helexa] TTFT, 1024-token prompt" in done.stderr  # progress lines

    report = json.loads(out.read_text())
    runs = {(r["model"], r["fmt"], r["side"]): r for r in report["runs"]}
    assert all(r["status"] == "ok" for r in runs.values())
    dense, moe = runs[("tiny-dense", "bf16", "helexa")], runs[("tiny-moe", "bf16", "helexa")]
    # tied lm_head = the embedding: every byte held is read; an MoE token reads 2 of 4 experts
    assert dense["bytes_per_token"] == dense["bytes_held"]
    assert moe["bytes_per_token"] < moe["bytes_held"]
    assert moe["settings"]["kv_cache_mb"] >= 1 and moe["settings"]["dtype"] == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_exits_2_with_one_clear_line():
    done = bench_gpu("--models", "tiny-dense")
    assert done.returncode == 2
    assert done.stderr.strip() == NO_CUDA
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [
        ("qwen3-0.6b", 0.596e9, 0.596e9),  # tied lm_head, counted once
        ("qwen3-8b", 8.19e9, 8.19e9),
        ("qwen3-30b-a3b", 30.53e9, 3.35e9),  # 8 of 128 experts a token
    ],
)
def test_presets_have_the_checkpoints_parameter_counts(preset, total, active):
    got_total, got_active = param_counts(PRESETS[preset])
    assert got_total == pytest.approx(total, rel=0.005)
    assert got_active == pytest.approx(active, rel=0.005)
