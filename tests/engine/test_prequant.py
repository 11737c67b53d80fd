"""Pre-quantized safetensors checkpoints (fp8 with block scales, AWQ, GPTQ): read from the
formats' own layouts (tests/engine/prequant_files.py writes them as their quantizers do),
kept quantized on the CPU (int4, int8) and in the accelerator's layouts (int4_zp, fp8_block),
and anything else refused at load as unsupported_quant."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers import prequant as held
from helexa.engine.layers.linear import Linear, UnsupportedQuantError
from helexa.engine.loader import prequant
from helexa.engine.loader.load import load_model
from helexa.engine.worker import linear_weights, load_failure
from helexa.kernels.quant_pack import naive_dequantize
from tests.engine.prequant_files import (
    dequantize_groups,
    pack_awq,
    pack_gptq,
    quantization_config,
    quantize_checkpoint,
    quantize_fp8_blocks,
    quantize_groups,
)
from tests.engine.test_parity import assert_same_greedy_run, record_model_logits
from tests.engine.tiny import make_tiny_model, make_tiny_new_family
from tests.shared_fixtures import needs_shared

CPU = torch.device("cpu")
# (method, quantizer options): AWQ's usual groups of 128; GPTQ v1 symmetric (its files store
# z - 1 = 7) and v2 asymmetric in groups of 32; fp8 in DeepSeek's 128 x 128 blocks
CASES = {
    "awq-g128": ("awq", dict(group_size=128)),
    "gptq-v1-sym-g128": ("gptq", dict(group_size=128, sym=True, v1=True)),
    "gptq-v2-asym-g32": ("gptq", dict(group_size=32, sym=False, v1=False)),
    "fp8-block128": ("fp8", dict(block=(128, 128))),
}
# the CPU layouts run bf16 activations and bf16 scales (int8 a per-channel requantization of
# fp8): logits of these tiny models (|logit| ~ 12) stay within these of the float reference
CPU_ATOL = {"awq": 0.3, "gptq": 0.3, "fp8": 0.8}
CPU_FORMAT = {"awq": "int4", "gptq": "int4", "fp8": "int8"}
DEVICE_KIND = {"awq": "int4_zp", "gptq": "int4_zp", "fp8": "fp8_block"}
# autotune off: a quantized Linear's path (the packed kernel's bf16 activations, or a float
# GEMM) would be chosen by timings, and a busy CI machine's choice moved the AWQ MoE's
# router across a near-tie (0.63 against the 0.3 the packed path keeps)
ENGINE = dict(
    device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory_mb=8, autotune=False
)


def source(method: str, shape: tuple[int, int], seed: int = 0, **opts):
    """A PrequantTensor of a random weight in `method`'s layout, and its dequantized float."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * 0.05
    scheme = prequant.scheme_of({"quantization_config": quantization_config(method, **opts)})
    if method == "fp8":
        q, scale, want = quantize_fp8_blocks(w, opts["block"])
        parts = {"weight": q, "weight_scale_inv": scale}
    else:
        group = opts["group_size"]
        codes, zeros, scales = quantize_groups(w, group, sym=opts.get("sym", False))
        want = dequantize_groups(codes, zeros, scales, group)
        if method == "awq":
            parts = pack_awq(codes, zeros, scales)
        else:
            parts = pack_gptq(codes, zeros, scales, group, v1=opts.get("v1", True))
    stream = prequant.gather(((f"m.{k}", v) for k, v in parts.items()), scheme)
    [(name, src)] = list(stream)
    assert name == "m.weight" and src.shape == shape
    return src, want


# -- reading the files ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "shape", "opts"),
    [
        ("awq", (40, 256), dict(group_size=128)),
        ("awq", (24, 192), dict(group_size=64)),
        ("awq", (8, 96), dict(group_size=-1)),
        ("gptq", (40, 256), dict(group_size=128, sym=True, v1=True)),
        ("gptq", (24, 96), dict(group_size=32, v1=False)),
        ("gptq", (8, 200), dict(group_size=-1, sym=True, v1=True)),
        ("fp8", (200, 160), dict(block=(128, 128))),
        ("fp8", (40, 96), dict(block=(16, 32))),
    ],
    ids=str,
)
def test_each_format_unpacks_to_its_reference_weights_exactly(method, shape, opts):
    src, want = source(method, shape, **opts)
    assert torch.equal(src.dequantize(), want)
    # the accelerator's layout holds the same weights, bit for bit, where its 32s fit
    if method == "fp8" or src.groups_of_32() is not None:
        qw = held.quant_weight(src)
        assert qw.kind == DEVICE_KIND[method]
        assert torch.equal(naive_dequantize(qw), want)
    else:  # in_features 200
        with pytest.raises(UnsupportedQuantError, match="groups of 32"):
            held.quant_weight(src)


def test_a_per_tensor_fp8_scale_is_one_scale_per_output_channel():
    q, scale, want = quantize_fp8_blocks(torch.randn(48, 64) * 0.05, (48, 64))
    scheme = prequant.scheme_of({"quantization_config": {"quant_method": "fp8"}})
    [(_, src)] = prequant.gather(
        [("m.weight", q), ("m.weight_scale", scale.reshape(1)), ("m.input_scale", scale)], scheme
    )
    assert torch.equal(src.dequantize(), want)
    qw = held.quant_weight(src)
    assert qw.kind == "fp8" and torch.equal(naive_dequantize(qw), want)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoints_hold_as_cpu_int4_to_the_bf16_scales(method):
    src, want = source(method, (48, 256), group_size=128)
    linear = Linear(256, 48)
    linear.load_weight(src, dtype=torch.float32, quant="int8")  # the file's quant wins
    assert linear.format == "int4"
    got = linear.dequantize()
    s = src.int4_groups()[1].float().repeat_interleave(128, dim=1)
    # scale and zero rounded to bf16 (2^-9 relative): (q - 8) * Δs + Δzero, |q - 8|, |8 - z| <= 8
    assert ((got - want).abs() <= 16 * s * 2**-9).all()
    assert (got - want).norm() / want.norm() < 4e-3


def test_fp8_holds_as_cpu_int8_requantized_per_output_channel():
    src, want = source("fp8", (48, 256), block=(128, 128))
    linear = Linear(256, 48)
    linear.load_weight(src, dtype=torch.float32, dense_copy=True)
    assert linear.format == "int8" and linear.scales.shape == (48,)
    step = want.abs().amax(dim=1, keepdim=True) / 127
    # half a step, and the bf16 rounding of the scale over 127 steps (a quarter of one)
    assert ((linear.dequantize() - want).abs() <= 0.8 * step).all()
    assert torch.equal(linear.dense, want)


def test_groups_that_split_a_run_of_32_hold_as_float_on_the_cpu_and_are_refused_on_device():
    src, want = source("gptq", (16, 96), group_size=48, v1=False)
    assert src.groups_of_32() is None
    linear = Linear(96, 16)
    linear.load_weight(src, dtype=torch.float32)
    assert linear.format == "float" and torch.equal(linear.weight, want)
    with pytest.raises(UnsupportedQuantError, match="groups of 32"):
        held.quant_weight(src)


# -- what is refused ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"quant_method": "exl2", "bits": 4.65}, "exl2"),
        ({"quant_method": "hqq", "nbits": 4}, "hqq"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_quantizations_are_refused_naming_what_they_are(config, named):
    with pytest.raises(UnsupportedQuantError, match=named) as e:
        prequant.scheme_of({"quantization_config": config})
    failed = load_failure(e.value)  # what the node answers: 422 unsupported_quant
    assert failed.kind == "unsupported_quant" and named in failed.message and failed.suggestion


def test_act_order_g_idx_is_refused_even_when_the_config_says_otherwise():
    src, _ = source("gptq", (16, 256), group_size=128, v1=False)
    src.parts["g_idx"] = torch.randperm(256, generator=torch.Generator().manual_seed(0)) // 128
    with pytest.raises(UnsupportedQuantError, match="g_idx"):
        src.dequantize()


def test_quantized_tensors_the_config_does_not_explain_are_refused():
    fp8 = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedQuantError, match="no quantization_config"):
        list(prequant.gather([("a.weight", torch.zeros(2)), ("b.weight", fp8)], None))
    awq = prequant.scheme_of({"quantization_config": quantization_config("awq", group_size=32)})
    with pytest.raises(UnsupportedQuantError, match="weight_scale_inv"):
        list(prequant.gather([("b.weight_scale_inv", torch.ones(1, 1))], awq))
    with pytest.raises(ValueError, match=r"without \['qzeros'"):
        list(prequant.gather([("b.qweight", torch.zeros(4, 1, dtype=torch.int32))], awq))


@needs_shared
def test_loading_an_unsupported_checkpoint_fails_before_reading_weights(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(model_dir / "model.safetensors"))  # never read
    with pytest.raises(UnsupportedQuantError, match="bitsandbytes"):
        load_model(str(model_dir), device=CPU)


# -- whole models through the loader -------------------------------------------------------
def tiny_checkpoints(tmp_path, case: str):
    """A tiny Qwen3 quantized as `case`, and the float checkpoint of its dequantized weights:
    dims multiple of 128 for AWQ/GPTQ's groups; fp8's intermediate 320 leaves a short block."""
    method, opts = CASES[case]
    inter = 320 if method == "fp8" else 384
    src, _ = make_tiny_model(
        "qwen3", tmp_path, hidden_size=256, intermediate_size=inter, head_dim=64
    )
    quantize_checkpoint(src, tmp_path / "quant", tmp_path / "ref", method, **opts)
    return method, tmp_path / "quant", tmp_path / "ref"


def greedy_runs(llm: LLM, prompts, steps: int = 12):
    seen = record_model_logits(llm.engine.runner.model)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [(o.token_ids, torch.stack(seen[o.request_id])) for o in outs]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(3, 40))]


@needs_shared
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prequantized_model_runs_in_the_cpu_layouts_close_to_its_float_weights(case, tmp_path):
    method, quant_dir, ref_dir = tiny_checkpoints(tmp_path, case)
    llm = LLM(str(quant_dir), **ENGINE)
    assert llm.engine.loaded.checkpoint_quant == method
    model = llm.engine.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.format == mlp.down_proj.format == CPU_FORMAT[method]
    # 2 layers x (qkv, o, gate_up, down) packed; the tied lm_head stays float
    assert linear_weights(model) == f"float×1 {CPU_FORMAT[method]}×8"
    ours = greedy_runs(llm, PROMPTS)
    ref = greedy_runs(LLM(str(ref_dir), **ENGINE), PROMPTS)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(ours, ref, strict=True):
        assert_same_greedy_run(
            tokens, logits, ref_tokens, ref_logits, f"{case} cpu", atol=CPU_ATOL[method]
        )


@needs_shared
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_accelerator_layouts_compute_the_float_weights_exactly(case, tmp_path, monkeypatch):
    # the layouts a GPU holds, run here through naive_quant_matmul: the same logits, bit for bit
    monkeypatch.setattr(held, "kernel_layout", lambda device: True)
    method, quant_dir, ref_dir = tiny_checkpoints(tmp_path, case)
    llm = LLM(str(quant_dir), **ENGINE)
    model = llm.engine.runner.model
    assert model.layers[1].mlp.gate_up_proj.qweight.kind == DEVICE_KIND[method]
    assert linear_weights(model) == f"float×1 {DEVICE_KIND[method]}×8"
    ours = greedy_runs(llm, PROMPTS)
    ref = greedy_runs(LLM(str(ref_dir), **ENGINE), PROMPTS)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert torch.equal(logits, ref_logits)


@needs_shared
@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
@pytest.mark.parametrize(
    ("method", "opts"), [("awq", dict(group_size=32)), ("fp8", dict(block=(32, 32)))]
)
def test_a_prequantized_moe_keeps_its_experts_quantized(
    method, opts, layout, tmp_path, monkeypatch
):
    # per-expert projections, as Qwen3-30B-A3B's AWQ and FP8 checkpoints name them; small
    # groups and blocks for the tiny experts (hidden 64, intermediate 32)
    if layout == "accelerator":  # stacked into one QuantWeight each, through quant_fused_moe
        monkeypatch.setattr(held, "kernel_layout", lambda device: True)
    src, _ = make_tiny_new_family("qwen3_moe", tmp_path)
    quantize_checkpoint(src, tmp_path / "quant", tmp_path / "ref", method, **opts)
    llm = LLM(str(tmp_path / "quant"), **ENGINE)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    if layout == "cpu":
        assert {e.down_proj.format for e in experts} == {CPU_FORMAT[method]}
    else:
        assert experts.qw13.kind == DEVICE_KIND[method]
        # fp8's down projection takes 32 inputs: one block across them, a scale per channel
        assert experts.qw2.kind == {"awq": "int4_zp", "fp8": "fp8"}[method]
    ours = greedy_runs(llm, PROMPTS)
    ref = greedy_runs(LLM(str(tmp_path / "ref"), **ENGINE), PROMPTS)
    # on the CPU, int8 moves this random MoE's logits by ~1 (quant = "int8" of its float
    # weights does the same: a near-tie in the router flips); the naive fused MoE sums in
    # another order than the float experts
    atol = {"awq": CPU_ATOL["awq"], "fp8": 1.5}[method] if layout == "cpu" else 1e-4
    for (tokens, logits), (ref_tokens, ref_logits) in zip(ours, ref, strict=True):
        assert_same_greedy_run(tokens, logits, ref_tokens, ref_logits, f"moe {method}", atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["awq-g128", "fp8-block128"])
def test_a_prequantized_model_runs_on_cuda_in_its_own_kernels(case, tmp_path):
    method, quant_dir, ref_dir = tiny_checkpoints(tmp_path, case)
    gpu = dict(ENGINE, device="cuda")
    llm = LLM(str(quant_dir), **gpu)
    assert llm.engine.runner.model.layers[0].mlp.down_proj.qweight.kind == DEVICE_KIND[method]
    ours = greedy_runs(llm, PROMPTS)
    ref = greedy_runs(LLM(str(ref_dir), **gpu), PROMPTS)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(ours, ref, strict=True):
        # fp32 activations: the kernels' 3xTF32 dots against cuBLAS's
        assert_same_greedy_run(tokens, logits, ref_tokens, ref_logits, f"{case} cuda", 1e-3)
