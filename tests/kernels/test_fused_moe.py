"""The routed experts: the naive version against HF's Qwen3_5MoeExperts, and only on the
tokens routed to each expert; the Triton version against the naive."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

from helexa.kernels.fused_moe import align_by_expert, naive_fused_moe, triton_fused_moe

from . import DEVICE, max_rel_error, needs_triton

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 60, 40, 6, 2


def moe_inputs(num_tokens: int, num_experts: int = NUM_EXPERTS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def test_naive_moe_matches_hf_experts():
    x, w13, w2, weights, ids = moe_inputs(63)
    config = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        hidden_act="silu",
    )
    experts = Qwen3_5MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        want = experts(x, ids, weights)
    torch.testing.assert_close(naive_fused_moe(x, w13, w2, weights, ids), want)


class MatmulRows(TorchFunctionMode):
    """Records (rows of the left operand, shape of the right) for every matmul."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__", "mm", "linear"):
            self.calls.append((args[0].shape[0], tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_naive_moe_runs_each_expert_only_on_its_own_tokens():
    x, w13, w2, weights, ids = moe_inputs(63)
    ids[:40] = torch.tensor([1, 3])  # expert 1 and 3 are popular; expert 5 gets no token
    ids[40:, 0] = 0
    ids[40:, 1] = torch.tensor([2, 4]).repeat(12)[:23]
    with MatmulRows() as mode:
        naive_fused_moe(x, w13, w2, weights, ids)
    gate_up = [rows for rows, shape in mode.calls if shape == (HIDDEN, 2 * INTER)]
    down = [rows for rows, shape in mode.calls if shape == (INTER, HIDDEN)]
    counts = [c for c in torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).tolist() if c]
    assert gate_up == down == counts  # one matmul pair per expert with tokens, its rows only
    assert sum(gate_up) == 63 * TOP_K


def test_alignment_groups_pairs_by_expert_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])  # experts 1, 3 and 4 get nothing
    sorted_pairs, block_expert = align_by_expert(ids, num_experts=6, block_m=4)
    real = block_expert >= 0
    assert block_expert[real].tolist() == [0, 2, 5]
    assert not real[3:].any()  # the blocks past the end are marked to be skipped
    blocks = sorted_pairs.view(-1, 4)[real].tolist()
    assert blocks == [[1, 4, 6, 6], [0, 2, 5, 6], [3, 6, 6, 6]]  # 6 = T*k: padding


def skewed_routing(ids: torch.Tensor) -> torch.Tensor:
    """Most tokens to expert 1, the rest spread over 0, 2, 3, 4; expert 5 gets none."""
    ids = ids.clone()
    ids[:, 0] = 1
    ids[:, 1] = torch.arange(ids.shape[0]) % 5
    ids[ids[:, 1] == 1, 1] = 0
    return ids


# Triton against naive, in fp32 with ieee dots: both sum H (or I) fp32 products, in a
# different order, so they agree to ~1e-6 of the output's scale; 1e-4 leaves room for silu.
@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 63])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_triton_moe_matches_naive(num_tokens, routing):
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in moe_inputs(num_tokens))
    if routing == "skewed":
        ids = skewed_routing(ids)
    out = triton_fused_moe(x, w13, w2, weights, ids)
    assert max_rel_error(out, naive_fused_moe(x, w13, w2, weights, ids)) < 1e-4


@needs_triton
def test_triton_moe_handles_an_expert_count_not_a_power_of_two_in_bf16():
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in moe_inputs(63, num_experts=5, seed=1))
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    out = triton_fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    # bf16 inputs to both paths; they differ by h's bf16 rounding order and the final
    # rounding, each ~2^-8 relative
    assert max_rel_error(out, naive_fused_moe(x, w13, w2, weights, ids)) < 2e-2
