"""Linear on an accelerator: weights held as kernels.QuantWeight (GGUF blocks as they are,
int8/int4/fp8 made at load) and run through kernels.quant_matmul; what has no kernel there is
refused. CI has no GPU, so the accelerator's layout is forced onto CPU tensors here."""

from __future__ import annotations

import pytest
import torch

import helexa.engine.layers.linear as linear_mod
import helexa.kernels as kernels
from helexa.engine.layers.linear import Linear, UnsupportedQuantError, fuse
from helexa.engine.loader.dequant import dequantize
from helexa.engine.loader.gguf import GGUFTensor
from tests.engine.tiny import make_tiny_new_family
from tests.kernels import needs_triton
from tests.shared_fixtures import needs_shared

GGUF_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture
def device_layout(monkeypatch):
    monkeypatch.setattr(linear_mod, "kernel_layout", lambda device: True)
    yield
    kernels.set_backend("auto")


def gguf_weight(qtype: str, out: int, inp: int, seed: int = 0) -> GGUFTensor:
    gen = torch.Generator().manual_seed(seed)
    raw = kernels.make_gguf_blocks(qtype, out, inp, generator=gen)
    return GGUFTensor(f"blk.{qtype}", qtype, (out, inp), raw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("qtype", GGUF_KINDS)
def test_gguf_blocks_stay_quantized_and_compute_with_their_exact_weights(qtype, device_layout):
    src = gguf_weight(qtype, 48, 512)
    lin = Linear(512, 48)
    lin.load_weight(src, dtype=torch.float32)
    assert lin.format == "quant" and lin.weight is None and lin.qweight.kind == qtype
    assert lin.memory_bytes <= 1.03 * src.data.nbytes  # not widened: GGUF's own size
    w = dequantize(src.data, qtype, src.shape)
    assert torch.equal(lin.dequantize(), w)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    assert rel_err(lin(x), x.double() @ w.double().T) < 1e-5


@pytest.mark.parametrize("quant", ["int8", "int4", "fp8"])
def test_float_weights_are_quantized_in_situ_on_the_device(quant, device_layout):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    lin = Linear(96, 64)
    lin.load_weight(w, dtype=torch.bfloat16, quant=quant)
    assert lin.format == "quant" and lin.qweight.kind == quant
    assert lin.memory_bytes < w.numel() * 1.2  # about a byte or less a weight, not 2 or 4
    bound = {"int8": 0.01, "fp8": 0.05, "int4": 0.12}[quant]
    assert rel_err(lin.dequantize(), w) < bound
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and rel_err(y, x.float() @ lin.dequantize().T) < 2e-2


@needs_triton
@pytest.mark.parametrize("rows", [1, 17, 300])  # GEMV, fused GEMM, dense (DENSE_MIN_M)
def test_the_triton_kernels_serve_a_quantized_linear(rows, device_layout):
    src = gguf_weight("Q4_K", 32, 256, seed=3)
    lin = Linear(256, 32, bias=True)
    lin.load_weight(src, dtype=torch.bfloat16)
    lin.load_bias(torch.randn(32), dtype=torch.bfloat16)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    kernels.set_backend("naive")
    want = lin(x)
    kernels.set_backend("triton")
    assert rel_err(lin(x), want) < 2e-2


def test_quantized_projections_of_one_kind_fuse_and_of_two_kinds_do_not(device_layout):
    q, k, v = (Linear(256, n) for n in (64, 32, 32))
    for i, m in enumerate((q, k, v)):
        m.load_weight(gguf_weight("Q4_K", m.out_features, 256, seed=i), dtype=torch.float32)
    fused = fuse([q, k, v])
    assert fused.format == "quant" and fused.split_sizes == [64, 32, 32]
    x = torch.randn(4, 256)
    assert torch.allclose(fused(x), torch.cat([q(x), k(x), v(x)], dim=-1), atol=1e-5)
    v.load_weight(gguf_weight("Q6_K", 32, 256), dtype=torch.float32)  # as Q4_K_M files do
    with pytest.raises(ValueError, match="held differently"):
        fuse([q, k, v])


def test_a_gguf_quant_without_a_kernel_is_refused_not_widened(device_layout):
    raw = torch.zeros(16, 256 // 32 * 22, dtype=torch.uint8)  # Q5_0: 22 bytes a block
    with pytest.raises(UnsupportedQuantError, match="Q5_0") as e:
        Linear(256, 16).load_weight(
            GGUFTensor("blk.0.q", "Q5_0", (16, 256), raw), dtype=torch.float32
        )
    assert "Q4_K" in str(e.value) and e.value.suggestion


def test_a_shape_the_kernels_cannot_take_is_refused(device_layout):
    with pytest.raises(UnsupportedQuantError, match="multiple of 32"):
        Linear(40, 16).load_weight(torch.randn(16, 40), dtype=torch.float32, quant="int4")


def test_fp8_on_the_cpu_is_refused():
    with pytest.raises(UnsupportedQuantError, match="CUDA"):
        Linear(64, 16).load_weight(torch.randn(16, 64), dtype=torch.float32, quant="fp8")


def test_moving_a_quantized_linear_moves_every_tensor_it_holds(device_layout):
    lin = Linear(256, 16)
    lin.load_weight(gguf_weight("Q5_K", 16, 256), dtype=torch.float32)
    before = lin.dequantize()
    lin.to(torch.float64)  # float tensors change dtype; the packed codes must stay as they are
    assert torch.equal(lin.dequantize(), before)


@needs_shared
def test_quantized_experts_are_stacked_for_the_fused_kernel_and_agree_with_the_sorted_path(
    device_layout, tmp_path, monkeypatch
):
    from helexa.engine import LLM, SamplingParams
    from helexa.engine.layers.moe import Experts

    model_dir, _ = make_tiny_new_family("qwen3_moe", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 57))]
    llm = LLM(str(model_dir), kv_cache_memory_mb=8, quant="int8")
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.qw13.kind == "int8" and experts.w13 is None
    assert tuple(experts.qw13.qs.shape) == (6 * 64, 64)  # E * 2I rows, quantized
    stacked = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(Experts, "_stack_quantized", lambda self: None)
    per_expert = LLM(str(model_dir), kv_cache_memory_mb=8, quant="int8")
    assert per_expert.engine.runner.model.layers[0].mlp.experts.qw13 is None
    assert [o.token_ids for o in per_expert.generate(prompts, params)] == stacked
