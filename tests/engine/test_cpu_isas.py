"""The native-kernel and quantization tests again as each narrower kind of CPU than this one
runs them: in a child process whose torch kernels (ATEN_CPU_CAPABILITY; oneDNN and MKL capped
alike) and native kernels (blocks.c built for that -march) take the narrower ISA's paths. The
suite itself ran this machine's own kind; a kind this CPU cannot run, or is, skips."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NOT_RUNNABLE = 77  # the child's exit code where this machine cannot be that kind


@dataclass(frozen=True, slots=True)
class CpuKind:
    """A kind of CPU the nodes run on, as a wider CPU can pretend to be it."""

    torch_capability: str  # ATEN_CPU_CAPABILITY: torch's int4/int8 kernels' path
    march: str  # what blocks.c is built for: which of its #ifdef paths it takes
    needs: tuple[str, ...]  # /proc/cpuinfo flags a CPU needs to run it
    hides: str  # a flag of wider CPUs: without it, this CPU is that kind already
    env: dict[str, str] = field(default_factory=dict)  # oneDNN and MKL held to it too


KINDS = {
    # an AVX-512 (bf16, VNNI) EPYC: AVX-512 without AMX
    "avx512": CpuKind(
        "avx512", "x86-64-v4", ("avx512f", "avx512bw", "avx512dq", "avx512vl"), "amx_tile",
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    ),
    "avx2": CpuKind(
        "avx2", "x86-64-v3", ("avx2", "fma", "f16c"), "avx512f",
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    ),
    # no AVX2: torch's scalar int4 kernels and blocks.c's #else loops
    "scalar": CpuKind(
        "default", "x86-64", ("sse2",), "avx2",
        {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    ),
}  # fmt: skip
ENGINE = "tests/engine"
TESTS = [
    f"{ENGINE}/test_int4_cpu.py",
    f"{ENGINE}/test_linear.py",
    f"{ENGINE}/test_linear_kernels.py",
    f"{ENGINE}/test_native.py",
    f"{ENGINE}/test_native_kquants.py",
    f"{ENGINE}/test_tensor_parallel_layers.py::test_a_shard_is_cut_from_the_float_weight_then_quantized",
    # run once, by the suite: a whole model on the blocks (~25 s with AVX2, minutes in scalar
    # C), and MoE experts through Triton's interpreter (numpy: no CPU path of ours or torch's)
    f"--deselect={ENGINE}/test_native.py::test_the_bundled_model_runs_on_the_blocks_and_its_prompt_logits_are_transformers",
    f"--deselect={ENGINE}/test_linear_kernels.py::test_quantized_experts_are_stacked_for_the_fused_kernel_and_agree_with_the_sorted_path",
]  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


class _NarrowedBuild:
    """A pytest plugin: blocks.c built for `march` before any test asks for it (after the
    conftest, which sets up Triton's interpreter before helexa.kernels imports Triton)."""

    def __init__(self, march: str) -> None:
        self.march = march

    def pytest_configure(self, config: pytest.Config) -> None:
        from helexa.engine.layers import native

        flags = (*(f for f in native.FLAGS if not f.startswith("-march")), f"-march={self.march}")
        native.FLAGS = flags
        native.library.cache_clear()  # whatever was built before is this CPU's own build
        if not native.available():  # the compiler's reason is logged
            pytest.exit(f"blocks.c does not build with -march={self.march} here", NOT_RUNNABLE)


def _pytest_as(name: str, *args: str) -> None:
    """The child: check that torch took `name`'s path, then run pytest on blocks.c built
    for it."""
    kind = KINDS[name]
    got = torch.backends.cpu.get_cpu_capability()
    if got.lower() != kind.torch_capability:
        print(f"torch runs {got} kernels here, not {kind.torch_capability}")
        sys.exit(NOT_RUNNABLE)
    plugins = [_NarrowedBuild(kind.march)]
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *args], plugins=plugins))


@pytest.mark.skipif(sys.platform != "linux", reason="CPU kinds are read from /proc/cpuinfo")
@pytest.mark.parametrize("name", list(KINDS))
def test_the_kernel_and_quantization_tests_pass_as_a_narrower_cpu(name):
    kind = KINDS[name]
    flags = _cpu_flags()
    if missing := [f for f in kind.needs if f not in flags]:
        pytest.skip(f"this CPU cannot run {name} code: it lacks {', '.join(missing)}")
    if kind.hides not in flags:
        pytest.skip(f"this CPU is {name} (no {kind.hides}): the suite itself ran these tests so")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=kind.torch_capability, **kind.env)
    code = (
        "import sys; from tests.engine.test_cpu_isas import _pytest_as; _pytest_as(*sys.argv[1:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, name, *TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    if done.returncode == NOT_RUNNABLE:
        pytest.skip(f"{name}: {out.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"as {name}:\n{out[-6000:]}"
    assert " passed" in out and " failed" not in out, out[-2000:]
