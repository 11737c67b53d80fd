"""`helexa bench gpu`: the harness end to end on CPU (--quick), its refusal without CUDA,
and the presets' sizes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from helexa.bench.gpu import NO_CUDA
from helexa.bench.random_models import PRESETS, kv_bytes_per_token, param_counts, state_bytes

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


@pytest.mark.parametrize(("preset", "active"), [("qwen3.6-27b", None), ("qwen3.6-35b-a3b", 3.45e9)])
def test_qwen36_presets_build_the_shapes_the_gguf_converter_writes(preset, active):
    from helexa.bench import gguf_files

    cfg, converted = PRESETS[preset], gguf_files.PRESETS[preset].config
    assert all(cfg[k] == v for k, v in converted.items() if k in cfg)
    total, got_active = param_counts(cfg)
    shapes = gguf_files.tensor_shapes(converted, mtp=False)  # helexa skips the MTP layer
    assert total == sum(math.prod(s) for s in shapes.values())
    assert got_active == pytest.approx(active or total, rel=0.005)


def test_a_hybrid_token_moves_every_gated_deltanet_layers_state():
    cfg = PRESETS["qwen3.6-27b"]
    gdn_layers = 64 - 64 // 4
    conv = (2 * 16 * 128 + 48 * 128) * (4 - 1) * 2  # bf16, the last kernel-1 inputs
    ssm = 48 * 128 * 128 * 4  # fp32, a [key, value] matrix per value head
    assert state_bytes(cfg) == gdn_layers * (conv + ssm)
    assert kv_bytes_per_token(cfg) == 2 * (64 // 4) * 4 * 256 * 2  # attention layers only
    assert state_bytes(PRESETS["qwen3-8b"]) == 0


def test_quick_hybrid_run_counts_the_state_in_the_bytes_per_token_and_prints_the_ceiling(
    tmp_path,
):
    out = tmp_path / "gpu.json"
    done = bench_gpu(
        "--device", "cpu", "--quick", "--models", "tiny-hybrid", "--formats", "q4_k",
        "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["status"] == "ok"
    assert run["state_bytes_per_token"] == 2 * state_bytes(PRESETS["tiny-hybrid"])
    assert run["bytes_per_token"] > run["state_bytes_per_token"] > 0
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("tiny-hybrid q4_k"))
    assert "recurrent state" in line and re.search(r"bandwidth ceiling [\d.]+ tok/s", line)
    assert table_rows(done.stdout)[0][4] == "n/a"  # no HF side for hybrid shapes
