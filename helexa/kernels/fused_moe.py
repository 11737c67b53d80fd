"""A mixture-of-experts layer's experts (SwiGLU MLPs), each token through its top-k of them.

out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j],
where w13[e] holds gate rows 0..I-1 then up rows I..2I-1 (HF's gate_up_proj layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


def naive_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts in plain torch, each run only on the tokens routed to it.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [T, k] float; topk_ids: [T, k]
    int. Returns [T, H] in x.dtype; the weighted sum over k is accumulated in fp32.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    # (token, slot) pairs sorted by expert: each expert's pairs are one contiguous run
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        gate_up = x[rows] @ w13[expert].T  # [n, 2I]
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        y = h.to(x.dtype) @ w2[expert].T  # [n, H]
        out.index_add_(0, rows, y.float() * weight_of[start : start + count, None])
        start += count
    return out.to(x.dtype)


def triton_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """As naive_fused_moe, in Triton."""
    raise NotImplementedError("triton_fused_moe: not written yet")
