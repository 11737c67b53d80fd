"""The kernels the model code calls, each routed to its Triton or its plain-torch version.

Rule: a call runs the Triton version when its first tensor is on CUDA and triton imports;
otherwise the `naive_*` one. The engine may override that once at start-up with
`set_backend`: "auto" (the rule), "naive" (always plain torch) or "triton" (always Triton; on
CPU tensors that means Triton's interpreter, TRITON_INTERPRET=1, which only tests want).
Nothing here reads the environment.

Shapes are in each function's docstring; the kernels live beside their twins in
causal_conv1d.py, gdn_gating.py, fused_moe.py, gated_delta_rule.py, paged_attention.py,
kv_store.py, quant_matmul.py and quant_moe.py (with quant_pack.py, the quantized weights'
layouts, and quant_dequant.py, a whole weight dequantized for the dense prefill path); the
decoder's and sampler's small ops in rms_norm.py, rotary.py, activation.py,
sampling.py and filtered_sample.py.
"""

from __future__ import annotations

import torch

from . import gated_delta_rule as gdr
from . import quant_dequant
from .activation import naive_silu_and_mul, triton_silu_and_mul
from .causal_conv1d import (
    naive_causal_conv1d,
    naive_causal_conv1d_update,
    triton_causal_conv1d,
    triton_causal_conv1d_update,
)
from .filtered_sample import naive_sample, triton_sample
from .fused_moe import moe_by_expert, naive_fused_moe, triton_fused_moe
from .gdn_gating import naive_gdn_gating, triton_gdn_gating
from .kv_store import naive_store_kv, triton_store_kv
from .paged_attention import (
    naive_paged_decode_attention,
    naive_paged_prefill_attention,
    triton_paged_decode_attention,
    triton_paged_prefill_attention,
)
from .quant_matmul import (
    QUANT_KINDS,
    QuantWeight,
    check_shape,
    make_gguf_blocks,
    naive_quant_matmul,
    pack_gguf,
    quantize,
    triton_quant_matmul,
    unsupported_reason,
)
from .quant_moe import naive_quant_fused_moe, triton_quant_fused_moe
from .rms_norm import naive_rms_norm, triton_rms_norm
from .rotary import naive_rotary, triton_rotary
from .sampling import (
    naive_apply_penalties,
    naive_apply_token_bitmask,
    triton_apply_penalties,
    triton_apply_token_bitmask,
)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

BACKENDS = ("auto", "naive", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose the backend for every later call: "auto", "naive" or "triton"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; supported: {BACKENDS}")
    if name == "triton" and not HAS_TRITON:
        raise RuntimeError("kernel backend 'triton' asked for, but triton is not installed")
    _backend = name


def backend() -> str:
    """The backend set by set_backend ("auto" unless changed)."""
    return _backend


def uses_triton(x: torch.Tensor) -> bool:
    """Whether a call whose first tensor is x runs the Triton version."""
    return triton_on(x.device)


def triton_on(device: torch.device) -> bool:
    """Whether calls on tensors of `device` run the Triton versions."""
    if _backend == "auto":
        return HAS_TRITON and device.type == "cuda"
    return _backend == "triton"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence's prompt: q, k [T, Hk, K]; v [T, Hv, V];
    g, beta [T, Hv]; initial_state [Hv, K, V] | None -> (o [T, Hv, V], state [Hv, K, V] fp32).
    Value head j reads q/k head j // (Hv/Hk), or j % Hk when `tiled` (llama.cpp's order)."""
    fn = gdr.triton_chunk_gated_delta_rule if uses_triton(q) else gdr.naive_chunk_gated_delta_rule
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, tiled=tiled)
    return fn(q, k, v, g, beta, initial_state, **kw)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    tiled: bool = False,
) -> torch.Tensor:
    """One decode step of N sequences: q, k [N, Hk, K]; v [N, Hv, V]; g, beta [N, Hv];
    state [S, Hv, K, V] fp32 pool, updated in place at rows state_indices [N] -> o [N, Hv, V].
    `tiled`: as chunk_gated_delta_rule's."""
    fn = (
        gdr.triton_fused_recurrent_gated_delta_rule
        if uses_triton(q)
        else gdr.naive_recurrent_gated_delta_rule
    )
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, tiled=tiled)
    return fn(q, k, v, g, beta, state, state_indices, **kw)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence: x [T, C], weight [C, W], bias [C] | None,
    initial_state [C, W-1] | None -> (out [T, C], final_state [C, W-1])."""
    fn = triton_causal_conv1d if uses_triton(x) else naive_causal_conv1d
    return fn(x, weight, bias, initial_state, activation=activation)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of N sequences: x [N, C], conv_state [S, C, W-1] pool updated in place
    at rows state_indices [N] (None: 0..N-1) -> out [N, C]."""
    fn = triton_causal_conv1d_update if uses_triton(x) else naive_causal_conv1d_update
    return fn(x, conv_state, weight, bias, state_indices, activation=activation)


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN gates: a, b [T, H]; A_log, dt_bias [H] -> (g, beta) fp32 [T, H]."""
    fn = triton_gdn_gating if uses_triton(a) else naive_gdn_gating
    return fn(A_log, a, b, dt_bias)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids [T, k]
    -> [T, H] in x.dtype."""
    fn = triton_fused_moe if uses_triton(x) else naive_fused_moe
    return fn(x, w13, w2, topk_weights, topk_ids)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step over the paged KV cache: q [N, H, D]; k_cache, v_cache [num_blocks,
    block_size, KVH, D]; block_tables [N, max_blocks] int32; context_lens [N] int32 (0: a
    padding row, zeros out) -> o [N, H, D]. The Triton path is CUDA-graph safe."""
    fn = triton_paged_decode_attention if uses_triton(q) else naive_paged_decode_attention
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
) -> torch.Tensor:
    """Causal attention of B sequences' new chunks over the paged KV cache (their K/V already
    in it): q [T, H, D]; cu_seqlens_q [B+1] int32; context_lens [B] int32 (prefix + chunk);
    block_tables [B, max_blocks] int32; max_seqlen_q a host int -> o [T, H, D]."""
    fn = triton_paged_prefill_attention if uses_triton(q) else naive_paged_prefill_attention
    return fn(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The new tokens' K/V into the paged cache, in place: k, v [T, KVH, D]; k_cache,
    v_cache [num_blocks, block_size, KVH, D]; slot_mapping [T] int (negative: a padding
    row, not written). The Triton path is one launch for both, CUDA-graph safe."""
    fn = triton_store_kv if uses_triton(k) else naive_store_kv
    fn(k, v, k_cache, v_cache, slot_mapping)


def quant_matmul(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with W held quantized (quant_matmul.QuantWeight [N, K], from
    pack_gguf or quantize): x [M, K] bf16/fp16/fp32, bias [N] | None -> [M, N] in x.dtype.
    On Triton, M >= quant_dequant.DENSE_MIN_M rows dequantize W into a reused scratch for
    F.linear; fewer, and any under CUDA-graph capture (a decode graph), run the fused kernels."""
    if not uses_triton(x):
        return naive_quant_matmul(x, qw, bias)
    rows = x.numel() // max(1, x.shape[-1])
    if rows >= quant_dequant.DENSE_MIN_M and not quant_dequant.capturing(x):
        return quant_dequant.dense_quant_matmul(x, qw, bias)
    return triton_quant_matmul(x, qw, bias)


def quant_fused_moe(
    x: torch.Tensor,
    w13: QuantWeight,
    w2: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe with every expert's weights stacked in one QuantWeight each: x [T, H],
    w13 [E*2I, H], w2 [E*H, I], topk_weights, topk_ids [T, k] -> [T, H] in x.dtype."""
    fn = triton_quant_fused_moe if uses_triton(x) else naive_quant_fused_moe
    return fn(x, w13, w2, topk_weights, topk_ids)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32 (HF's rounding): x [..., D], weight [D] -> out [..., D]; with a
    residual (as x): new_residual = x + residual, normalised -> (out, new_residual)."""
    fn = triton_rms_norm if uses_triton(x) else naive_rms_norm
    return fn(x, weight, eps, residual)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary over each head's first R dims: q [T, Hq, D], k [T, Hk, D]; cos,
    signed_sin [T, 1, R] (R <= D even, the sign folded into sin) -> new (q, k)."""
    fn = triton_rotary if uses_triton(q) else naive_rotary
    return fn(q, k, cos, signed_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    fn = triton_silu_and_mul if uses_triton(x) else naive_silu_and_mul
    return fn(x)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output: in place on logits [N, V], -inf for every token whose bit in
    bitmask [N, >= ceil(V / 32)] int32 (bit t % 32 of word t // 32) is clear; words past
    the logits' width are not read."""
    fn = triton_apply_token_bitmask if uses_triton(logits) else naive_apply_token_bitmask
    fn(logits, bitmask)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    num_output: int,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Repetition (over prompt and output), frequency and presence (over output) penalties,
    in place on logits [N, V] fp32: rows, tokens [P] int (row, token id) pairs, the first
    num_output (a host int) the output tokens; repetition, frequency, presence [N] fp32."""
    fn = triton_apply_penalties if uses_triton(logits) else naive_apply_penalties
    fn(logits, rows, tokens, num_output, repetition, frequency, presence)


def sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """One token per row: logits, noise (Exp(1) draws) [N, V] fp32; temperature, top_p,
    min_p [N] fp32, top_k [N] int (0: off) -> [N] int64; temperature 0 or top_k 1 is greedy,
    else argmax(prob / noise) over the tokens top-k, top-p and min-p keep. The Triton path
    does not sort and does not sync with the host."""
    fn = triton_sample if uses_triton(logits) else naive_sample
    return fn(logits, noise, temperature, top_k, top_p, min_p)


__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "QUANT_KINDS",
    "QuantWeight",
    "apply_penalties",
    "backend",
    "causal_conv1d",
    "causal_conv1d_update",
    "check_shape",
    "chunk_gated_delta_rule",
    "fused_moe",
    "fused_recurrent_gated_delta_rule",
    "gdn_gating",
    "make_gguf_blocks",
    "moe_by_expert",
    "pack_gguf",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quant_fused_moe",
    "quant_matmul",
    "quantize",
    "rms_norm",
    "rotary",
    "sample",
    "set_backend",
    "silu_and_mul",
    "store_kv",
    "unsupported_reason",
    "uses_triton",
]
