"""Routed experts over quantized weights: the naive version against a per-token loop over the
dequantized experts, the Triton version against the naive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import helexa.kernels as kernels
from helexa.kernels.quant_matmul import (
    GGUF_KINDS,
    QuantWeight,
    cat_rows,
    make_gguf_blocks,
    naive_dequantize,
    pack_gguf,
    quantize,
)
from helexa.kernels.quant_moe import naive_quant_fused_moe, triton_quant_fused_moe

from . import DEVICE, max_rel_error, needs_triton

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 256, 256, 6, 2


def stacked(kind: str, rows: int, cols: int, gen: torch.Generator) -> QuantWeight:
    """Every expert's [rows, cols] weight stacked, as GGUF holds ffn_*_exps."""
    if kind in GGUF_KINDS:
        raw = make_gguf_blocks(kind, NUM_EXPERTS * rows, cols, generator=gen)
        return pack_gguf(raw, kind, (NUM_EXPERTS * rows, cols))
    experts = [quantize(torch.randn(rows, cols, generator=gen) * 0.05, kind) for _ in range(6)]
    return cat_rows(experts)


def moe_inputs(num_tokens: int, kind13: str, kind2: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = stacked(kind13, 2 * INTER, HIDDEN, gen)
    w2 = stacked(kind2, HIDDEN, INTER, gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    weights, ids = torch.randn(num_tokens, NUM_EXPERTS, generator=gen).softmax(-1).topk(TOP_K)
    return x, w13, w2, weights, ids


def test_naive_matches_a_loop_over_each_tokens_experts():
    x, w13, w2, weights, ids = moe_inputs(9, "Q4_K", "Q6_K")
    gate_up = naive_dequantize(w13).view(NUM_EXPERTS, 2 * INTER, HIDDEN)
    down = naive_dequantize(w2).view(NUM_EXPERTS, HIDDEN, INTER)
    want = torch.zeros(9, HIDDEN)
    for t in range(9):
        for j in range(TOP_K):
            e = ids[t, j]
            gate, up = (gate_up[e] @ x[t]).split(INTER)
            want[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    got = naive_quant_fused_moe(x, w13, w2, weights, ids)
    assert max_rel_error(got, want) < 1e-5


def test_shapes_that_do_not_stack_are_refused():
    x, w13, w2, weights, ids = moe_inputs(2, "Q8_0", "Q8_0")
    with pytest.raises(ValueError, match="need w13"):
        naive_quant_fused_moe(x[:, :128], w13, w2, weights, ids)


@needs_triton
@pytest.mark.parametrize(
    ("kind13", "kind2", "num_tokens", "dtype"),
    [
        ("Q4_K", "Q6_K", 1, torch.bfloat16),  # a decode step: 16-row blocks
        ("Q4_K", "Q6_K", 40, torch.bfloat16),  # 80 pairs > 4 per expert: 64-row blocks
        ("Q8_0", "Q5_K", 5, torch.float32),
        ("int4", "fp8", 5, torch.bfloat16),
        ("int8", "Q4_0", 3, torch.float32),
    ],
)
def test_triton_matches_naive(kind13, kind2, num_tokens, dtype):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, kind13, kind2)
    x = x.to(DEVICE, dtype)
    w13, w2, weights, ids = w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    got = triton_quant_fused_moe(x, w13, w2, weights, ids)
    want = naive_quant_fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    # bf16: h is rounded to bf16 between the two GEMMs, and the output once
    assert max_rel_error(got, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_the_dispatcher_takes_the_naive_path_on_cpu():
    x, w13, w2, weights, ids = moe_inputs(3, "Q4_0", "Q8_0")
    want = naive_quant_fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(kernels.quant_fused_moe(x, w13, w2, weights, ids), want)


@needs_triton
def test_triton_with_no_tokens():
    x, w13, w2, weights, ids = moe_inputs(0, "Q4_0", "Q4_0")
    assert triton_quant_fused_moe(x, w13, w2, weights, ids).shape == (0, HIDDEN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_cuda_at_qwen3_30b_a3b_shapes_and_in_a_graph(num_tokens):
    # Qwen3-30B-A3B: 128 experts of 2048 -> 768, top-8; Q4_K gate/up, Q6_K down
    num_experts, hidden, inter, top_k = 128, 2048, 768, 8
    gen = torch.Generator().manual_seed(0)
    raw13 = make_gguf_blocks("Q4_K", num_experts * 2 * inter, hidden, generator=gen)
    raw2 = make_gguf_blocks("Q6_K", num_experts * hidden, inter, generator=gen)
    w13 = pack_gguf(raw13, "Q4_K", (num_experts * 2 * inter, hidden)).to("cuda")
    w2 = pack_gguf(raw2, "Q6_K", (num_experts * hidden, inter)).to("cuda")
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda")
    weights, ids = logits.softmax(-1).topk(top_k)
    want = naive_quant_fused_moe(x, w13, w2, weights, ids)
    assert max_rel_error(triton_quant_fused_moe(x, w13, w2, weights, ids), want) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_quant_fused_moe(x, w13, w2, weights, ids)
    ids.copy_(torch.randn(num_tokens, num_experts, device="cuda").topk(top_k).indices)
    graph.replay()
    assert max_rel_error(y, naive_quant_fused_moe(x, w13, w2, weights, ids)) < 2e-2
