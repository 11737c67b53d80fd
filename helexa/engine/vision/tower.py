"""The Qwen3.5 / Qwen3.6 vision encoder: pixel patches in, one embedding of the decoder's width
per merge² patches out.

patch embedding (a linear map of each flattened patch) + the learned position table resampled
to the image's grid → `depth` pre-norm blocks (attention within each image, 2-D rotary on
q and k) → the merger (LayerNorm, merge² neighbours concatenated, two linears). Patches
arrive in merge-block order (preprocess.patches), so a merge is a plain view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.engine.vision.inputs import ImageInput, VisionProfile
from helexa.engine.vision.preprocess import patches

# The activations `hidden_act` names, as torch spells them.
_ACTS = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        assert hidden % num_heads == 0, f"hidden {hidden} not divisible by {num_heads} heads"
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        # x: [num_patches, hidden]; cos, sin: [num_patches, 1, head_dim] float32
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # q, k, v: [1, num_heads, num_patches, head_dim]: the fused SDPA kernels (flash on
        # CUDA and on the CPU) take 4-D inputs only, 3-D ones fall back to the math path.
        q = _rotate(q, cos, sin).transpose(0, 1)[None]
        k = _rotate(k, cos, sin).transpose(0, 1)[None]
        v = v.transpose(0, 1)[None]
        # Each image attends to itself only: one non-causal call per image (a block-diagonal
        # mask over the whole batch would cost num_patches² memory).
        out = [
            F.scaled_dot_product_attention(qi, ki, vi)
            for qi, ki, vi in zip(
                q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True
            )
        ]
        return self.proj(torch.cat(out, 2)[0].transpose(0, 1).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in float32 whatever the weights' dtype (as the reference), rotate-half layout."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos + rotated * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {sorted(_ACTS)}")
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = VisionAttention(hidden, num_heads)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge² neighbouring patches → one token of the decoder's width. The norm is per
    patch, before the neighbours are concatenated."""

    def __init__(self, hidden: int, merge: int, out_hidden: int) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is one linear map of a flattened patch;
    held as that (its [hidden, C, T, P, P] kernel loads flattened)."""

    def __init__(self, patch_dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class VisionTower(nn.Module):
    """The encoder, from config.json's `vision_config`. Weight names are the checkpoint's
    after `model.visual.`."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        cfg = vision_config
        hidden = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_heads"])
        self.patch_size = int(cfg.get("patch_size", 16))
        self.merge_size = int(cfg.get("spatial_merge_size", 2))
        self.temporal_patch_size = int(cfg.get("temporal_patch_size", 2))
        in_channels = int(cfg.get("in_channels", 3))
        num_positions = int(cfg.get("num_position_embeddings", 2304))
        self.side = math.isqrt(num_positions)
        assert self.side * self.side == num_positions, f"{num_positions} positions not a square"
        head_dim = hidden // self.num_heads
        assert head_dim % 4 == 0, f"head_dim {head_dim}: rotary needs h and w halves of pairs"
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")

        patch_dim = in_channels * self.temporal_patch_size * self.patch_size**2
        self.patch_embed = PatchEmbed(patch_dim, hidden)
        self.pos_embed = nn.Embedding(num_positions, hidden)
        self.blocks = nn.ModuleList(
            VisionBlock(hidden, self.num_heads, int(cfg["intermediate_size"]), act)
            for _ in range(int(cfg["depth"]))
        )
        self.merger = PatchMerger(hidden, self.merge_size, int(cfg["out_hidden_size"]))
        # head_dim // 4 frequencies per axis: h and w each take a quarter of the head,
        # doubled for the rotate-half pairs.
        exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels: [num_patches, patch_dim] in merge-block order, images one after another;
        grids: each image's (t, h, w) in patches. Returns [num_patches // merge², out_hidden]."""
        weight = self.patch_embed.proj.weight
        lengths = [t * h * w for t, h, w in grids]
        assert pixels.shape[0] == sum(lengths), f"{pixels.shape[0]} patches for grids {grids}"
        tables = [_grid_tables(t, h, w, self.merge_size, self.side) for t, h, w in grids]
        rows, cols, taps, tap_weights = (
            torch.cat(parts).to(weight.device, non_blocking=True)
            for parts in zip(*tables, strict=True)
        )
        # x: [num_patches, hidden]
        x = self.patch_embed(pixels.to(weight.dtype))
        positions = (self.pos_embed.weight[taps].float() * tap_weights[..., None]).sum(1)
        x = x + positions.to(x.dtype)
        # freqs: [num_patches, head_dim // 2], the h frequencies then the w ones
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), -1)
        angles = torch.cat((freqs, freqs), -1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput], profile: VisionProfile) -> list[torch.Tensor]:
        """One forward over all `images`; each image's [num_tokens, out_hidden] embeddings."""
        weight = self.patch_embed.proj.weight
        grids = [image.grid(profile) for image in images]
        pixels = torch.cat([patches(image, profile) for image in images])
        out = self(pixels.to(weight.device, weight.dtype, non_blocking=True), grids)
        return list(out.split([t * h * w // self.merge_size**2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names after `model.visual.`) into the parameters, in the
        parameters' dtype; an unknown name or a wrong size raises."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise KeyError(f"unknown vision tower weight {name!r}")
            if tensor.numel() != param.numel():
                raise ValueError(
                    f"vision tower weight {name!r}: {tuple(tensor.shape)} into {tuple(param.shape)}"
                )
            # The Conv3d kernel [hidden, C, T, P, P] flattens to the linear's [hidden, C*T*P*P].
            with torch.no_grad():
                param.copy_(tensor.reshape(param.shape))
            loaded.add(name)
        return loaded


@functools.lru_cache(maxsize=64)
def _grid_tables(
    t: int, h: int, w: int, merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each patch of a (t, h, w) grid in merge-block order: its row and column (float32,
    the rotary's positions), and the 4 taps into the side×side position table with their
    bilinear weights (align_corners: the table's corners sit on the grid's corners)."""
    assert h % merge == 0 and w % merge == 0, f"grid {h}x{w} not a multiple of {merge}"
    # Raster index of each patch, taken in merge-block order.
    order = torch.arange(h * w).view(h // merge, merge, w // merge, merge).transpose(1, 2)
    order = order.flatten().repeat(t)
    rows, cols = order // w, order % w
    row_lo, row_hi, row_frac = _axis_taps(rows, h, side)
    col_lo, col_hi, col_frac = _axis_taps(cols, w, side)
    taps = torch.stack(
        (
            row_lo * side + col_lo,
            row_lo * side + col_hi,
            row_hi * side + col_lo,
            row_hi * side + col_hi,
        ),
        -1,
    )
    tap_weights = torch.stack(
        (
            (1 - row_frac) * (1 - col_frac),
            (1 - row_frac) * col_frac,
            row_frac * (1 - col_frac),
            row_frac * col_frac,
        ),
        -1,
    )
    return rows.float(), cols.float(), taps, tap_weights


def _axis_taps(
    index: torch.Tensor, size: int, side: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along one axis: the two table entries around each of `size` positions spread evenly
    over the table's `side` entries, and the fraction of the way to the upper one."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    return lo.long(), (lo.long() + 1).clamp(max=side - 1), src - lo
