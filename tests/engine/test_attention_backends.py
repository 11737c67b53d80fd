"""The attention backends: one chosen per runner from its device, kernels and dtypes, and a
Triton decode step with nothing outside its kernels but the model's own matmuls."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import helexa.kernels as kernels
from helexa.engine import LLM, SamplingParams
from helexa.engine.attention import (
    NativeAttention,
    SdpaAttention,
    TritonAttention,
    select_backend,
)
from helexa.engine.layers import native
from tests.engine.tiny import make_tiny_model
from tests.kernels import needs_triton
from tests.shared_fixtures import needs_shared

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _auto_backend_after():
    yield
    kernels.set_backend("auto")  # the backend is process-wide


def test_a_cpu_runner_takes_native_for_a_float32_model_and_sdpa_otherwise():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    want = NativeAttention if native.available() else SdpaAttention
    assert type(select_backend(CPU, f32, f16, 16)) is want
    assert type(select_backend(CPU, f32, f32, 16)) is want
    assert type(select_backend(CPU, bf16, bf16, 16)) is SdpaAttention  # the kernel is float32
    kernels.set_backend("naive")  # an A/B run of plain torch: no native kernels either
    assert type(select_backend(CPU, f32, f16, 16)) is SdpaAttention


@needs_triton
def test_kernels_triton_takes_the_triton_backend_on_any_device():
    kernels.set_backend("triton")
    backend = select_backend(CPU, torch.float32, torch.float32, 16)
    assert type(backend) is TritonAttention and backend.captures_graphs


class _OurOps(TorchDispatchMode):
    """Counts aten ops by name, leaving out those Triton's interpreter makes to run a kernel
    on the CPU (its copies in and out of each launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _in_interpreter(sys._getframe(1)):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _in_interpreter(frame) -> bool:
    while frame is not None:
        name = frame.f_code.co_filename
        if "triton" in name and "interpreter" in name:
            return True
        frame = frame.f_back
    return False


@needs_shared
@needs_triton
def test_a_triton_decode_step_runs_no_cache_copies_casts_or_reductions(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)  # float32 weights: plain F.linear
    llm = LLM(str(model_dir), kernels="triton", dtype="float32", kv_cache_memory_mb=8)
    runner = llm.engine.runner
    assert all(a.backend is runner.attention for a in runner.attention_layers)
    model, decode_steps = runner.model, []
    inner = model.forward

    def counting(input_ids, positions, ctx):
        if ctx.prefills:  # a prompt step: not counted
            return inner(input_ids, positions, ctx)
        with _OurOps() as counter:
            out = inner(input_ids, positions, ctx)
        decode_steps.append(counter.ops)
        return out

    model.forward = counting
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7, 8], [9, 10]], params)
    assert len(decode_steps) == 2
    for ops in decode_steps:
        assert ops["linear"] > 0, ops  # the counter sees the model's own ops
        # the new K/V reach the cache inside one kernel (no index_copy_), in the cache's
        # dtype (no casts), and attention reduces inside its kernel
        unwanted = {"index_copy_", "index_put_", "to", "_to_copy", "copy_", "sum"}
        assert not unwanted & set(ops), ops
