"""Linear: every weight representation computes x @ W.T for the W its source describes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helexa.engine.layers import int4_cpu, native
from helexa.engine.layers.linear import Linear, _q4_as_int4, _q8_0_as_int4, fuse
from helexa.engine.loader.gguf import GGUFTensor

# Packed kernels run in bf16 (activations and scales): ~0.3% rms error on a matmul.
BF16_RTOL = 1e-2
F32_RTOL = 1e-5


def quantized(w: torch.Tensor, qtype: str) -> tuple[GGUFTensor, torch.Tensor]:
    """`w` encoded by gguf's reference quantizer, and gguf's reference dequantization of it."""
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w.numpy(), kind)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    data = torch.from_numpy(raw.view(np.uint8)).reshape(w.shape[0], -1)
    return GGUFTensor("w", qtype, tuple(w.shape), data), ref


def weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(params=["auto", "torch"])
def cpu_kernels(request):
    """Each GGUF block test under both CPU paths: the native kernels ("auto", where they
    build) and torch's packed int4; yields the format the blocks are then held in."""
    native.set_mode(request.param)
    yield "blocks" if native.enabled() else "int4"
    native.set_mode("auto")


@pytest.fixture
def torch_int4():
    """Tests of torch's int4 packing itself: GGUF Q4/Q8 blocks held in it."""
    native.set_mode("torch")
    yield
    native.set_mode("auto")


def loaded(src, dtype=torch.float32, quant=None, bias: torch.Tensor | None = None) -> Linear:
    lin = Linear(src.shape[1], src.shape[0], bias=bias is not None)
    lin.load_weight(src, dtype=dtype, quant=quant)
    if bias is not None:
        lin.load_bias(bias, dtype=dtype)
    return lin


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_exactly_the_int4_kernel_formula(qtype):
    src, ref = quantized(weight(64, 1536), qtype)
    q, scale, zero = _q4_as_int4(src.data, qtype, src.shape)
    groups = (q.float() - 8).reshape(64, -1, 32) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(groups.reshape(ref.shape), ref, rtol=1e-6, atol=1e-7)
    # and torch's kernel computes exactly that when it is given float32 scales
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    scales = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    x = torch.randn(3, 1536)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
    torch.testing.assert_close(y, F.linear(x, ref), rtol=1e-4, atol=1e-4)


def test_q8_0_blocks_are_exactly_two_int4_halves():
    src, ref = quantized(weight(48, 576), "Q8_0")
    q, scale, zero = _q8_0_as_int4(src.data, src.shape)
    halves = (q.float() - 8).reshape(48, -1, 32) * scale[..., None] + zero[..., None]
    halves = halves.reshape(48, 2, 576)
    assert torch.equal(halves[:, 0] + halves[:, 1], ref)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("inp", "out"), [(576, 192), (1536, 64), (576, 1040)])
def test_gguf_blocks_stay_packed_and_match_the_reference_dequantization(
    qtype, inp, out, cpu_kernels
):
    src, ref = quantized(weight(out, inp), qtype)
    lin = loaded(src)
    assert lin.format == cpu_kernels
    for m in (1, 3, 17):
        x = torch.randn(m, inp)
        y = lin(x)
        assert y.dtype == torch.float32
        assert rel_err(y, F.linear(x, ref)) < BF16_RTOL
    assert rel_err(lin.dequantize(), ref) < BF16_RTOL


def test_q4_blocks_stay_4_bit_whatever_quant_asks(cpu_kernels):
    src, _ = quantized(weight(192, 576), "Q4_0")
    assert [loaded(src, quant=q).format for q in (None, "int8", "int4")] == [cpu_kernels] * 3


def test_packed_weights_are_a_fraction_of_float(cpu_kernels):
    src, _ = quantized(weight(192, 576), "Q4_1")
    lin = loaded(src)
    if cpu_kernels == "blocks":  # the file's 20 bytes a block of 32, no more
        assert lin.memory_bytes == src.data.numel() == 192 * 576 // 32 * 20
    else:  # half a byte per weight, plus a bf16 (scale, zero) pair per 32
        assert lin.memory_bytes == 192 * 576 // 2 + 192 * 576 // 32 * 4
    assert lin.memory_bytes < loaded(weight(192, 576)).memory_bytes / 5


def test_q8_0_as_int8_is_opt_in_and_lossy_but_close():
    src, ref = quantized(weight(256, 576), "Q8_0")
    lin = loaded(src, quant="int8")
    assert lin.format == "int8"
    assert lin.memory_bytes < loaded(src).memory_bytes
    x = torch.randn(5, 576)
    assert rel_err(lin(x), F.linear(x, ref)) < 3e-2


@pytest.mark.parametrize(("quant", "bound"), [("int8", 2e-2), ("int4", 0.15)])
def test_float_weights_quantize_on_request(quant, bound):
    w = weight(208, 1536)
    lin = loaded(w, quant=quant)
    assert lin.format == quant
    x = torch.randn(3, 1536)
    # the layer computes with the weight it holds, and that weight is close to w
    assert rel_err(lin(x), F.linear(x, lin.dequantize())) < BF16_RTOL
    assert rel_err(lin.dequantize(), w) < bound


def test_float_weights_without_quant_stay_exact():
    w = weight(192, 576)
    x = torch.randn(17, 576)
    torch.testing.assert_close(loaded(w)(x), F.linear(x, w), rtol=F32_RTOL, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q5_0", "F16"])
def test_other_qtypes_are_dequantized_to_the_load_dtype(qtype):
    src, ref = quantized(weight(64, 576), qtype)
    lin = loaded(src)
    assert lin.format == "float"
    assert lin.weight.dtype == torch.float32
    x = torch.randn(3, 576)
    torch.testing.assert_close(lin(x), F.linear(x, ref), rtol=F32_RTOL, atol=1e-5)


def test_shapes_the_kernels_reject_fall_back_to_float(cpu_kernels):
    src, ref = quantized(weight(40, 576), "Q4_1")  # 40 rows: int4 packing needs multiples of 16
    assert loaded(src).format == ("blocks" if cpu_kernels == "blocks" else "float")
    native.set_mode("torch")
    assert loaded(src, quant="int8").format == "float"  # Q4 blocks go int4 or nowhere
    assert loaded(weight(64, 48), quant="int8").format == "float"  # in_features not 32-aligned
    x = torch.randn(2, 576)
    torch.testing.assert_close(loaded(src)(x), F.linear(x, ref), rtol=F32_RTOL, atol=1e-5)


def test_weights_off_the_cpu_are_quantized_for_the_kernels_not_kept_float():
    lin = loaded(torch.empty(64, 576, device="meta"), quant="int4")
    assert lin.format == "quant" and lin.weight is None
    assert lin.qweight.kind == "int4" and lin.qweight.device.type == "meta"
    plain = loaded(torch.empty(64, 576, device="meta"))  # no quant asked: float as given
    assert plain.format == "float" and plain.weight.device.type == "meta"


def test_moving_a_packed_layer_off_the_cpu_dequantizes_it():
    src, ref = quantized(weight(64, 576), "Q4_1")
    lin = loaded(src, dtype=torch.bfloat16)
    dense = lin.dequantize()
    lin.to("meta")
    assert lin.format == "float"
    assert (lin.weight.device.type, lin.weight.dtype) == ("meta", torch.bfloat16)
    assert rel_err(dense, ref) < BF16_RTOL


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_bias_and_leading_dims(quant):
    w, b = weight(192, 576), torch.randn(192)
    lin = loaded(w, quant=quant, bias=b)
    x = torch.randn(2, 5, 576)
    y = lin(x)
    assert y.shape == (2, 5, 192)
    assert rel_err(y, F.linear(x, lin.dequantize(), b)) < BF16_RTOL
    torch.testing.assert_close(y[1], lin(x[1]))


def test_bf16_activations_come_back_bf16():
    src, ref = quantized(weight(192, 576), "Q4_1")
    lin = loaded(src, dtype=torch.bfloat16)
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, F.linear(x.float(), ref)) < BF16_RTOL


def make_linears(kind: str, outs: list[int], with_bias: bool) -> list[Linear]:
    lins = []
    for i, out in enumerate(outs):
        w = weight(out, 576, seed=i)
        bias = torch.randn(out) if with_bias and i != 1 else None  # one part without a bias
        if kind in ("Q4_1", "Q8_0"):
            lins.append(loaded(quantized(w, kind)[0], bias=bias))
        else:
            lins.append(loaded(w, quant=kind, bias=bias))
    return lins


@pytest.mark.parametrize("kind", [None, "int8", "int4", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_equals_separate(kind, with_bias):
    outs = [576, 192, 208]  # q, k, v; the last part need not fill a packing block
    parts = make_linears(kind, outs, with_bias)
    fused = fuse(parts)
    assert fused.split_sizes == outs
    assert fused.memory_bytes == sum(p.memory_bytes for p in parts)
    x = torch.randn(3, 7, 576)
    for got, part in zip(fused(x).split(fused.split_sizes, dim=-1), parts, strict=True):
        torch.testing.assert_close(got, part(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_blocks_fuse_whether_their_rows_come_in_8s_or_not(kind):
    """Rows in 8s are held interleaved ("x8"), others in the file's order; a fuse of both is
    interleaved again where its total allows."""
    parts = make_linears(kind, [576, 36, 20], with_bias=True)
    if parts[0].format != "blocks":
        pytest.skip("no native kernels here")
    assert [p.block_kind for p in parts] == [f"{kind}x8", kind, kind]
    fused = fuse(parts)
    assert fused.block_kind == f"{kind}x8" and fused.out_features == 632
    assert fused.memory_bytes == sum(p.memory_bytes for p in parts)
    x = torch.randn(5, 576)
    for got, part in zip(fused(x).split(fused.split_sizes, dim=-1), parts, strict=True):
        torch.testing.assert_close(got, part(x), rtol=1e-5, atol=1e-5)
    odd = fuse(make_linears(kind, [576, 36], with_bias=False))  # 612 rows: the file's order
    assert odd.block_kind == kind
    torch.testing.assert_close(odd.dequantize(), torch.cat([p.dequantize() for p in parts[:2]]))


def test_fuse_refuses_what_it_cannot_concatenate():
    with pytest.raises(ValueError, match="held differently"):
        fuse(make_linears(None, [64], False) + make_linears("int8", [64], False))
    native.set_mode("torch")  # torch's int4 packing interleaves 64-row blocks
    try:
        with pytest.raises(ValueError, match="64-row multiples"):
            fuse(make_linears("Q4_1", [208, 192], False))
    finally:
        native.set_mode("auto")
    if native.enabled():  # the file's blocks are rows: any count concatenates
        assert fuse(make_linears("Q4_1", [208, 192], False)).out_features == 400


def test_unknown_quant_is_rejected():
    with pytest.raises(ValueError, match="unknown quant 'nf4'"):
        loaded(weight(64, 576), quant="nf4")


def add_dense_copy(lin: Linear) -> None:
    """What the loader does with `dense_copies`: an f32 copy of a packed weight."""
    from helexa.engine.layers.linear import DENSE_DTYPE

    if lin.format != "float" and lin.dense is None:
        lin.dense = lin.dequantize().to(DENSE_DTYPE).contiguous()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int4"])
def test_a_dense_copy_serves_the_row_counts_its_plan_gives_it_with_the_same_weights(kind):
    from helexa.engine.layers.autotune import BUCKETS, DENSE, WHOLE, plan_for_rows
    from helexa.engine.layers.linear import DENSE_DTYPE

    parts = make_linears(kind, [576, 192], with_bias=True)
    for p in parts:
        add_dense_copy(p)
    fused = fuse(parts)
    assert fused.dense is not None and fused.dense.dtype == DENSE_DTYPE
    fused.plans = plan_for_rows([WHOLE if b < 16 else DENSE for b in BUCKETS])
    few, many = torch.randn(8, 576), torch.randn(36, 576)  # buckets 8 and 64
    for x in (few, many):
        ref = torch.nn.functional.linear(x, fused.dequantize(), fused.bias)
        assert rel_err(fused(x), ref) < 1e-2  # the packed path computes in bf16

    def via_dense(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, fused.dense) + fused.bias

    assert torch.equal(fused(many), via_dense(many))  # 36 rows: the f32 copy, as planned
    assert not torch.equal(fused(few), via_dense(few))  # 8 rows: the packed kernel


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_rows_run_in_chunks_as_planned_give_what_one_call_gives(kind):
    from helexa.engine.layers.autotune import BUCKETS, WHOLE, plan_for_rows

    (lin,) = make_linears(kind, [192], with_bias=True)
    x = torch.randn(100, 576)
    whole = lin(x)
    lin.plans = plan_for_rows([WHOLE if b < 8 else (False, 8) for b in BUCKETS])
    torch.testing.assert_close(lin(x), whole, rtol=0, atol=0)  # 13 calls, same rows


def test_a_prefill_step_takes_a_float32_path_whatever_its_row_count():
    from helexa.engine.layers.linear import PREFILL_STEP

    (lin,) = make_linears("Q4_1", [576], with_bias=False)
    add_dense_copy(lin)
    lin.exact_rows = 4  # as the autotune would set it
    x = torch.randn(3, 576)
    exact = torch.nn.functional.linear(x, lin.dense)
    token = PREFILL_STEP.set(True)
    try:
        if lin.format == "blocks":  # few rows: the native float32 kernel on the exact blocks
            torch.testing.assert_close(lin(x), exact, rtol=1e-5, atol=1e-5)
            wide = torch.randn(lin.exact_rows + 1, 576)  # more: the GEMM on the weight
            assert torch.equal(lin(wide), torch.nn.functional.linear(wide, lin.dense))
        else:  # the f32 copy, not the bf16 packed kernel
            assert torch.equal(lin(x), exact)
    finally:
        PREFILL_STEP.reset(token)
    assert rel_err(lin(x), exact) > 1e-4  # a decode call: the packed kernel's rounding


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out", [64, 1024, 3072])
def test_single_rows_read_from_the_packing_are_the_rows_of_the_weight(qtype, out, torch_int4):
    # how a tied embedding looks tokens up in the lm_head's packed table
    src, ref = quantized(weight(out, 576, seed=out), qtype)
    lin = loaded(src)
    assert lin.format == "int4" and lin.can_read_rows()
    ids = torch.tensor([0, 1, out // 2, out - 1, 5, 5])
    # the kernel holds scales in bf16: that rounding, and nothing else, separates them
    assert rel_err(lin.rows(ids), ref[ids]) < 5e-3
    # dequantize() unpacks the same nibbles and scales the same way
    assert torch.equal(lin.rows(ids), lin.dequantize()[ids])


def test_a_packing_with_a_short_last_block_is_read_by_rows_too(torch_int4):
    src, ref = quantized(weight(1040, 576), "Q4_1")  # 1040 rows: 16 past the last whole block
    lin = loaded(src)
    assert lin.format == "int4" and lin.can_read_rows()
    ids = torch.tensor([0, 1023, 1024, 1031, 1039])
    assert torch.equal(lin.rows(ids), lin.dequantize()[ids])
    assert rel_err(lin.rows(ids), ref[ids]) < 5e-3


def test_a_packing_whose_layout_is_unknown_is_read_through_the_kernel(torch_int4, monkeypatch):
    monkeypatch.setattr(int4_cpu, "layout", lambda: None)  # a torch packing some other way
    src, ref = quantized(weight(64, 576), "Q4_1")
    lin = loaded(src)
    assert lin.format == "int4" and not lin.can_read_rows()
    # the kernel run on an identity: its output rounded to bf16
    assert rel_err(lin.dequantize(), ref) < 5e-3


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("out", [100, 96])  # held in the file's order; interleaved in 8s
def test_rows_of_the_files_blocks_are_exactly_the_gguf_rows(qtype, out):
    src, ref = quantized(weight(out, 576, seed=3), qtype)
    lin = loaded(src)
    if lin.format != "blocks":
        pytest.skip("no native kernels here")
    ids = torch.tensor([0, 1, 50, out - 1, 5, 5])
    assert lin.can_read_rows() and torch.equal(lin.rows(ids), ref[ids])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_without_a_dense_copy_a_float32_plan_dequantizes_the_weight_for_the_call(kind):
    from helexa.engine.layers.autotune import BUCKETS, DENSE, WHOLE, plan_for_rows

    (lin,) = make_linears(kind, [192], with_bias=False)
    w = lin.dequantize()
    ids = torch.tensor([0, 7, 100, 191])
    assert torch.equal(w[ids], lin.rows(ids))  # the block unpacking and the row reads agree
    lin.plans = plan_for_rows([WHOLE if b < 64 else DENSE for b in BUCKETS])
    wide, narrow = torch.randn(100, 576), torch.randn(3, 576)
    assert lin.dense is None
    assert torch.equal(lin(wide), torch.nn.functional.linear(wide, w))  # float32, no copy kept
    assert rel_err(lin(narrow), torch.nn.functional.linear(narrow, w)) < 1e-2  # bf16 kernel


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_rows_read_with_the_unrounded_scales_are_the_gguf_rows(qtype):
    from helexa.engine.layers.linear import int4_scales

    src, ref = quantized(weight(1024, 576, seed=3), qtype)
    lin = loaded(src)
    ids = torch.tensor([0, 3, 512, 1023])
    torch.testing.assert_close(lin.rows(ids, int4_scales(src)), ref[ids], rtol=1e-6, atol=1e-7)
