"""bench/kernels.py: its tables on CPU (--quick, --only), and every case's Triton calls at
tiny sizes (Triton's interpreter without CUDA) against their naive twins, so that a GPU run
finds no call it cannot make."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import DEVICE, needs_triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
NUMBER = re.compile(r"[\d,]+(\.\d+)?")
TITLE = re.compile(r"^(gdn|moe|attention|quant|small): .* per call \(")

# tiny sizes for the interpreter; rotate: enough bytes for 2 or 3 copies of the smallest input
TINY = {
    "gdn": dict(Hk=1, Hv=2, D=16, W=4, prefill=(9,), decode=(2,)),
    "moe": dict(H=256, I=256, E=4, k=2, T=(3,), quant_T=(1, 5)),
    "attention": dict(H=4, KVH=2, D=32, block=16, decode=((1, 64), (3, 40)),
                      prefill=((1, 33, 0), (2, 9, 40)), rotate=40_000),
    # quick (the timed test): one row; every call at both row counts is the other test's
    "quant": dict(shapes=((256, 48),), M=(1, 5), quick_M=(1,), rotate=10_000),
    "small": dict(N=3, hidden=64, Hq=4, Hk=2, D=32, I=48, vocab=1000, O=4, P=8),
}  # fmt: skip
# these update their state (or logits) in place: each call sees the last one's output
STATEFUL = ("causal_conv1d_update", "recurrent_gated_delta_rule", "apply_penalties")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench(*args: str) -> subprocess.CompletedProcess:
    # one thread: the naive paths at reduced sizes gain nothing from more, and lose much to a
    # busy neighbour
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


def tables(stdout: str) -> dict[str, list[list[str]]]:
    """group -> its rows' cells: the lines after a title's header and rule, as wide as it."""
    lines, found = stdout.splitlines(), {}
    for i, line in enumerate(lines):
        if not (m := TITLE.match(line)):
            continue
        rule = lines[i + 2]
        spans = [s.span() for s in re.finditer(r"-+", rule)]
        rows = itertools.takewhile(lambda r, width=len(rule): len(r) == width, lines[i + 3 :])
        found[m.group(1)] = [[row[a:b].strip() for a, b in spans] for row in rows]
    return found


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the full-size run takes minutes")
def test_quick_on_cpu_prints_every_group_with_numbers():
    done = bench("--quick")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("device: CPU") and "torch " in out and "triton " in out
    assert "copy bandwidth:" in out
    found = tables(out)
    assert list(found) == ["gdn", "moe", "attention", "quant", "small"]
    labels = {g: [r[0] for r in rows] for g, rows in found.items()}
    assert any(x.startswith("quant_fused_moe Q4_K/Q6_K") for x in labels["moe"])
    assert any(x.startswith("paged_decode") for x in labels["attention"])
    assert any(x.startswith("paged_prefill") for x in labels["attention"])
    kinds = ("bf16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "int8", "int4", "fp8")
    assert all(any(f" {k} " in x for x in labels["quant"]) for k in kinds)
    assert [x.split()[0] for x in labels["small"]] == [
        "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "apply_penalties", "sample",
    ]  # fmt: skip
    for group, rows in found.items():
        for row in rows:
            assert "error" not in row, (group, row)
            # naive timed, Triton not (CPU); F.linear, torch's, in the triton column
            timed = row[2] if row[0].startswith("F.linear") else row[1]
            assert NUMBER.fullmatch(timed), (group, row)
    decode = next(r for r in found["attention"] if r[0].startswith("paged_decode"))
    assert decode[-2].endswith("%")  # % of the copy bandwidth


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the full-size run takes minutes")
def test_only_runs_the_named_groups_in_order():
    done = bench("--quick", "--only", "small,gdn")
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tables(done.stdout)) == ["small", "gdn"]
    assert "copy bandwidth:" not in done.stdout  # neither reports bandwidth

    done = bench("--only", "attention,nope")
    assert done.returncode == 2
    assert "unknown group(s) nope" in done.stderr


def outputs(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []  # in place (penalties)


@needs_triton
@pytest.mark.parametrize("group", list(TINY))
def test_every_case_runs_its_triton_calls_and_matches_naive(group):
    mod = load_bench()
    torch.manual_seed(0)
    cases_of = mod.GROUPS[group][0]
    cases = list(cases_of(DEVICE, torch.bfloat16, False, TINY[group]))
    assert cases
    if group in ("attention", "quant"):  # rotation: some case reads 2 or more copies
        assert max(len(c.fast) for c in cases) >= 2
    for case in cases:
        got = [outputs(fn()) for fn in case.fast]  # every copy's call runs
        if case.naive is None or case.label.startswith(STATEFUL):  # nothing to compare
            continue
        want = outputs(case.naive())
        for g, w in zip(got[0], want, strict=True):
            assert g.shape == w.shape, case.label
            if not w.is_floating_point():  # sampled tokens
                assert torch.equal(g, w), case.label
                continue
            err = (g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)
            assert err < 3e-2, (case.label, float(err))


@needs_triton
@pytest.mark.parametrize("group", ["attention", "quant"])
def test_a_group_timed_with_triton_fills_every_column(group, capsys):
    # as on CUDA, but eagerly through the interpreter, at tiny sizes, one call a batch
    mod = load_bench()
    mod.run_group(group, DEVICE, torch.bfloat16, True, 1e-6, 1e9, True, TINY[group])
    rows = tables(capsys.readouterr().out)[group]
    assert rows
    for row in rows:
        kernel, naive, fast, speedup, *figures = row
        assert NUMBER.fullmatch(fast), row
        if not kernel.startswith("F.linear"):
            assert NUMBER.fullmatch(naive) and speedup.endswith("x"), row
        assert sum(NUMBER.fullmatch(f) is not None for f in figures) == 1, row  # GB/s or TFLOP/s
