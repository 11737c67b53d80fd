"""The routed experts: the naive version against HF's Qwen3_5MoeExperts, and only on the
tokens routed to each expert; the Triton version against the naive."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

from helexa.kernels.fused_moe import naive_fused_moe

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
