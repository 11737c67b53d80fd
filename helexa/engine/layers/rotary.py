"""Rotary position embeddings (rotate-half layout, as HF stores Llama/Qwen weights): the
cos/sin tables here; `helexa.kernels.rotary` applies them to q and k."""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, max_pos: int):
    factor = s["factor"]
    old_ctx = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def dim_for(rot: float) -> float:
        return (head_dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


class RotaryEmbedding:
    """Precomputed cos/sin tables; `lookup(positions)` once per step serves every layer."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None = None,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        inv = _inv_freq(head_dim, theta)
        if freq_factors is not None:  # GGUF `rope_freqs`: llama3 scaling baked per frequency
            assert freq_factors.shape == inv.shape, (tuple(freq_factors.shape), tuple(inv.shape))
            inv = inv / freq_factors.float()
            scaling = None
        mscale = 1.0
        rope_type = "default"
        if scaling:
            rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: "
                    f"{list(SUPPORTED_ROPE_TYPES)}"
                )
            if rope_type == "linear":
                inv = inv / scaling["factor"]
            elif rope_type == "llama3":
                inv = _llama3(inv, scaling)
            elif rope_type == "yarn":
                inv, mscale = _yarn(inv, scaling, head_dim, theta, max_position)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)  # [max_position, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * mscale
        # sin with the rotate-half sign folded in: rotate_half(x) * sin == flip(x) * signed_sin
        sin = emb.sin() * mscale
        half = head_dim // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.mrope_axis: torch.Tensor | None = None  # set by with_mrope

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # -> cos, sin: [num_tokens, 1, head_dim], broadcast over heads
        if self.cos.device != positions.device:
            self.cos = self.cos.to(positions.device)
            self.sin = self.sin.to(positions.device)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    def with_mrope(self, section: list[int]) -> RotaryEmbedding:
        """Take M-RoPE positions too (`lookup_mrope`): `section` frequencies each for the
        temporal, height and width axes, interleaved as Qwen3-VL / Qwen3.5 lay them out
        (frequency j follows height when j % 3 == 1 and j < 3 * section[1], width when
        j % 3 == 2 and j < 3 * section[2], time otherwise)."""
        half = self.cos.shape[1] // 2  # the reference applies the rule whatever the sum
        axis = [0] * half
        for j in range(half):
            if j % 3 == 1 and j < 3 * section[1]:
                axis[j] = 1
            elif j % 3 == 2 and j < 3 * section[2]:
                axis[j] = 2
        self.mrope_axis = torch.tensor(axis + axis, dtype=torch.long)
        return self

    def lookup_mrope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions: [3, num_tokens] (t, h, w) -> cos, sin: [num_tokens, 1, head_dim]; each
        # frequency's angle from its own axis's position (text rows: all three the same)
        cos, sin = self.lookup(positions.reshape(-1), torch.float32)
        n, d = positions.shape[1], cos.shape[-1]
        axis = self.mrope_axis.to(positions.device).expand(1, n, d)
        cos = cos.view(3, n, d).gather(0, axis)[0]
        sin = sin.view(3, n, d).gather(0, axis)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
