"""Gated DeltaNet, the linear-attention mixer of Qwen3.5/3.6 (and Qwen3-Next).

Per token: project to q, k, v (one matmul), a short causal depthwise conv over them, then
the gated delta rule keeps a [K, V] state per value head instead of a KV cache. Each
sequence's state is two tensors in pools the model runner allocates (rows = state slots):

- `conv_state` [num_slots, conv_dim, kernel - 1]: the last inputs of the conv;
- `ssm_state` [num_slots, Hv, K, V] (float32): the delta-rule state.

Prefill segments run the whole-prompt conv and the chunked delta rule from their slot's
state (zeros for a fresh sequence) and write the final state back; decode rows update
their slots in place with the one-step kernels. Kernels come from `helexa.kernels`.

Value heads come in the checkpoint's order, `linear_value_head_order`: HF's "grouped" (value
head j reads key head j // (Hv/Hk)) or llama.cpp's "tiled" (j reads key head j % Hk, the order
its GGUF converter writes). The layer keeps that order end to end (v rows and conv channels,
z, a, b, A_log, dt_bias, the state, out_proj's columns) and tells the kernels which it is, so a
GGUF's tensors load as the file holds them, quantized blocks and all.

Tensor parallel splits the heads: each rank holds Hk/N key heads and the Hv/N value heads
that read them: one run of value heads when grouped, Hv/Hk runs (one per tile) when tiled; a
rank's own heads then keep the same order. The packed in_proj_qkv rows and conv channels are
[q of all key heads | k of all key heads | v of all value heads], so a rank holds slices of
each; z, a, b, A_log and dt_bias are per value head; out_proj is row-parallel over the value
channels and all-reduces; the gated norm's weight (per head dim) is replicated. States are per
rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from helexa import kernels
from helexa.engine.layers.linear import as_dense, column_parallel, row_parallel
from helexa.engine.parallel import Shard, shard_range

if TYPE_CHECKING:
    from helexa.engine.layers.attention import AttentionContext
    from helexa.engine.layers.linear import WeightSource


class RMSNormGated(nn.Module):
    """RMSNorm over the head dim, then times silu(gate): o = w * norm(x) * silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    PARAMS = ("weight",)

    def load_param(self, name: str, src: WeightSource, dtype: torch.dtype) -> None:
        """Its weight as stored: a plain scale, not Qwen3.5's (1 + w) of the other norms."""
        w = as_dense(src)
        assert name == "weight" and w.shape == self.weight.shape, (name, tuple(w.shape))
        self.weight.data = w.to(dtype).contiguous()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., dim]
        h = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        h = self.weight * h.to(x.dtype)
        return (h.float() * F.silu(gate.float())).to(x.dtype)


VALUE_HEAD_ORDERS = ("grouped", "tiled")


class GatedDeltaNet(nn.Module):
    """The `linear_attn` block of a Qwen3.5 `linear_attention` layer."""

    def __init__(self, hf: dict, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.num_k_heads = hf["linear_num_key_heads"]
        self.num_v_heads = hf["linear_num_value_heads"]
        self.head_k_dim = hf["linear_key_head_dim"]
        self.head_v_dim = hf["linear_value_head_dim"]
        self.conv_kernel = hf.get("linear_conv_kernel_dim", 4)
        order = hf.get("linear_value_head_order", "grouped")
        if order not in VALUE_HEAD_ORDERS:
            raise ValueError(
                f"unsupported linear_value_head_order {order!r}; supported: {VALUE_HEAD_ORDERS}"
            )
        self.is_tiled = order == "tiled"
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        key_dim, value_dim, group = hk * dk, hv * dv, hv // hk
        conv_dim = 2 * key_dim + value_dim
        # This rank's key heads and the value heads that read them (all at world size 1).
        k0, k1 = shard_range(hk, "linear_num_key_heads")
        if self.is_tiled:  # value heads [Hv/Hk, Hk]: the rank's key heads in every tile
            v_heads = tuple((i * hk + k0, i * hk + k1) for i in range(group))
        else:
            v_heads = ((k0 * group, k1 * group),)
        v_channels = tuple((a * dv, b * dv) for a, b in v_heads)
        qkv_rows = (
            (k0 * dk, k1 * dk),
            (key_dim + k0 * dk, key_dim + k1 * dk),
            *((2 * key_dim + a, 2 * key_dim + b) for a, b in v_channels),
        )
        self.in_proj_qkv = column_parallel(hidden_size, conv_dim, rows=qkv_rows)
        self.in_proj_z = column_parallel(hidden_size, value_dim, rows=v_channels)
        self.in_proj_b = column_parallel(hidden_size, hv, rows=v_heads)
        self.in_proj_a = column_parallel(hidden_size, hv, rows=v_heads)
        self.out_proj = row_parallel(value_dim, hidden_size, cols=v_channels)
        # The checkpoint's conv channels and per-value-head tensors this rank holds.
        self.conv_shard = Shard(0, conv_dim, qkv_rows)
        self.head_shard = Shard(0, hv, v_heads)
        self.num_k_heads = k1 - k0  # local from here on
        self.num_v_heads = self.num_k_heads * group
        self.key_dim = self.num_k_heads * dk
        self.value_dim = self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.norm = RMSNormGated(self.head_v_dim, eps)
        # Loaded as checkpoint tensors (load_param); kept in float32, as the gating runs in it.
        self.conv_weight: torch.Tensor | None = None  # [conv_dim, kernel] (HF conv1d.weight)
        self.A_log: torch.Tensor | None = None  # [Hv]
        self.dt_bias: torch.Tensor | None = None  # [Hv]
        # State pools, allocated by the model runner.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    # -- what the runner and loader need ----------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (conv_state, ssm_state)."""
        return (
            (self.conv_dim, self.conv_kernel - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    PARAMS = ("conv1d.weight", "A_log", "dt_bias")

    def load_param(self, name: str, src: WeightSource, dtype: torch.dtype) -> None:
        """A checkpoint tensor that is not a Linear's: `conv1d.weight`, `A_log`, `dt_bias`
        (this rank's channels and value heads of them)."""
        w = as_dense(src)
        if name == "conv1d.weight":  # [conv_dim, 1, kernel]
            w = self.conv_shard.take(w.reshape(self.conv_shard.total, self.conv_kernel))
            self.conv_weight = w.to(dtype).contiguous()
        elif name in ("A_log", "dt_bias"):
            assert tuple(w.shape) == (self.head_shard.total,), (name, tuple(w.shape))
            setattr(self, name, self.head_shard.take(w).float().contiguous())
        else:
            raise ValueError(f"unexpected GatedDeltaNet weight {name!r}")

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        for name in ("conv_weight", "A_log", "dt_bias", "conv_state", "ssm_state"):
            if (t := getattr(self, name)) is not None:
                setattr(self, name, fn(t))
        return super()._apply(fn, recurse)

    # -- running -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens = x.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv = self.in_proj_qkv.forward(x)  # [T, conv_dim]
        z = self.in_proj_z.forward(x).view(num_tokens, hv, dv)
        g, beta = kernels.gdn_gating(
            self.A_log, self.in_proj_a.forward(x), self.in_proj_b.forward(x), self.dt_bias
        )  # [T, Hv] each, float32
        o = x.new_empty(num_tokens, hv, dv)

        def split(mixed: torch.Tensor):
            n = mixed.shape[0]
            q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return q.view(n, hk, dk), k.view(n, hk, dk), v.reshape(n, hv, dv)

        for seg in ctx.prefills:
            s, rows = seg.state_slot, slice(seg.start, seg.end)
            fresh = seg.cached == 0  # the chunk starts at position 0
            conv0 = None if fresh else self.conv_state[s]
            mixed, conv_end = kernels.causal_conv1d(qkv[rows], self.conv_weight, None, conv0)
            self.conv_state[s] = conv_end
            ssm0 = None if fresh else self.ssm_state[s]
            out, ssm_end = kernels.chunk_gated_delta_rule(
                *split(mixed), g[rows], beta[rows], ssm0, tiled=self.is_tiled
            )
            self.ssm_state[s] = ssm_end
            o[rows] = out

        if ctx.decode_rows is not None:
            rows, slots = ctx.decode_rows, ctx.decode_state_slots
            xd = qkv if ctx.all_decode else qkv[rows]
            mixed = kernels.causal_conv1d_update(xd, self.conv_state, self.conv_weight, None, slots)
            gd, bd = (g, beta) if ctx.all_decode else (g[rows], beta[rows])
            out = kernels.fused_recurrent_gated_delta_rule(
                *split(mixed), gd, bd, self.ssm_state, slots, tiled=self.is_tiled
            )
            if ctx.all_decode:
                o = out
            else:
                o[rows] = out

        o = self.norm.forward(o, z)
        return self.out_proj.forward(o.reshape(num_tokens, self.value_dim))
