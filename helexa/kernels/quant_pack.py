"""Quantized weights laid out for the quant_matmul kernels: GGUF blocks repacked, or made here.

A `QuantWeight` holds one [out_features, in_features] weight as planar tensors, each
[out_features, ...] row-major, so rows of any of them belong to one output channel (fusing
Linears is `cat_rows`). Along a row, element k is in group k // G, where G = GROUP[kind] (16 for
Q6_K, whose scales cover 16 weights; 32 for the rest). 4-bit codes are two per byte, split by
half-group (GGUF Q4_0's order, for every kind): byte g*G/2 + j holds element g*G + j in its low
nibble and element g*G + G/2 + j in its high one. A kernel that loads a run of bytes so gets
the two halves of each group as two tiles, each beside a contiguous run of x.

    kind       qs (codes)   qh (high bits)  scales         mins           d, dmin         bits/w
    Q4_0       u8 [N, K/2]  -               f16 [N, K/32]  -              -               4.5
    Q4_1       u8 [N, K/2]  -               f16 [N, K/32]  f16 [N, K/32]  -               5.0
    int4       u8 [N, K/2]  -               f16 [N, K/32]  f16 [N, K/32]  -               5.0
    Q8_0       i8 [N, K]    -               f16 [N, K/32]  -              -               8.5
    Q4_K       u8 [N, K/2]  -               u8 [N, K/32]   u8 [N, K/32]   f16 [N, K/256]  4.625
    Q5_K       u8 [N, K/2]  i32 [N, K/32]   u8 [N, K/32]   u8 [N, K/32]   f16 [N, K/256]  5.625
    Q6_K       u8 [N, K/2]  i32 [N, K/16]   i8 [N, K/16]   -              f16 [N, K/256]  6.5625
    int8       i8 [N, K]    -               f32 [N]        -              -               8 + 32/K
    fp8        u8 [N, K]    -               f32 [N]        -              -               8 + 32/K
    int4_zp    u8 [N, K/2]  -               f16 [N, K/32]  u8 [N, K/32]   -               4.75
    fp8_block  u8 [N, K]    -               f32 [N, K/32]  -              -               9

Weights, with q the code (low nibble | high bits << 4; bit b*e of a group's int32 qh is the
lowest high bit of its element e, b = 1 for Q5_K and 2 for Q6_K): Q4_0 d*(q-8); Q4_1 d*q + m;
int4 the same (Q4_1's layout, made by `quantize`); Q8_0 d*q; Q4_K and Q5_K (d*sc)*q - dmin*mn,
sc and mn 6-bit per 32; Q6_K (d*sc)*(q-32), sc int8 per 16; int8 s*q; fp8 s * e4m3(q), the
e4m3 bits kept as uint8 (so every device, and Triton's interpreter, decodes them with integer
ops: no fp8 dtype or fp8 hardware needed). Against GGUF's bytes: Q4_0, Q4_1, Q8_0 and Q6_K
the same size; Q4_K 148/144 and Q5_K 180/176 (the 6-bit scales and mins unpacked to bytes).
The products above are exact in fp32, so `naive_dequantize` equals the loader's GGUF
dequantization bit for bit.

Two kinds hold pre-quantized checkpoints exactly (`pack_zero_point`, `pack_fp8_blocks`; the
loader's prequant.py reads the files): int4_zp s*(q - z), an AWQ or GPTQ weight, z the
group's integer zero point (0..16: GPTQ v1 files store z - 1), its scales in the file's dtype
(f16 as a rule; bf16 or f32 kept as they come); fp8_block s * e4m3(q), an fp8 checkpoint's
weight with its block scales (128 x 128 as a rule). Their groups (AWQ/GPTQ's 128, fp8's
blocks) are wider than the kernels' 32: each group's scale (and zero) is repeated over its
32s, and fp8's block scale over its rows, which costs 0.75 and 1 bit a weight over the files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

QUANT_KINDS = (
    *("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"),  # GGUF's
    *("int8", "int4", "fp8"),  # made at load from float weights (`quantize`)
    *("int4_zp", "fp8_block"),  # pre-quantized checkpoints (AWQ / GPTQ, fp8 block-scaled)
)
GGUF_KINDS = QUANT_KINDS[:6]
QK_K = 256  # weights per super-block of the k-quants
GROUP = {kind: 16 if kind == "Q6_K" else 32 for kind in QUANT_KINDS}
# in_features must be a multiple of this: the GGUF block, else the kernels' group
BLOCK = {kind: QK_K if kind.endswith("_K") else 32 for kind in QUANT_KINDS}
# GGUF qtype -> bytes per block
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
FP8_MAX = 448.0  # largest finite e4m3 (fn) value


@dataclass
class QuantWeight:
    """One [out_features, in_features] weight, packed for the kernels (layout: module doc)."""

    kind: str  # one of QUANT_KINDS
    out_features: int
    in_features: int
    qs: torch.Tensor  # codes: 4-bit pairs (uint8 [N, K/2]) or bytes ([N, K])
    scales: torch.Tensor  # per group, or per output channel (int8, fp8)
    qh: torch.Tensor | None = None  # int32 high bits per group (Q5_K, Q6_K)
    mins: torch.Tensor | None = None  # per group (Q4_1, int4, Q4_K, Q5_K; int4_zp's zeros)
    d: torch.Tensor | None = None  # f16 per super-block of 256 (k-quants)
    dmin: torch.Tensor | None = None  # f16 per super-block (Q4_K, Q5_K)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held."""
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.out_features * self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantWeight:
        """The weight with `fn` applied to every tensor it holds (a move, a dtype pass)."""
        mapped = {
            f.name: fn(t)
            for f in fields(self)
            if isinstance(t := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **mapped)

    def to(self, device: torch.device | str) -> QuantWeight:
        return self.map(lambda t: t.to(device))

    def rows(self, ids: torch.Tensor) -> QuantWeight:
        """Output channels `ids` [n] as an [n, in_features] weight (every tensor is per row)."""
        return replace(self.map(lambda t: t[ids]), out_features=ids.shape[0])


def cat_rows(weights: Sequence[QuantWeight]) -> QuantWeight:
    """Several weights of one kind and in_features as one, their rows stacked (fused Linears)."""
    first = weights[0]
    if len({(w.kind, w.in_features) for w in weights}) != 1:
        raise ValueError("cat_rows needs weights of one kind and in_features")
    stacked = {
        f.name: torch.cat([getattr(w, f.name) for w in weights])
        for f in fields(first)
        if isinstance(getattr(first, f.name), torch.Tensor)
    }
    return replace(first, out_features=sum(w.out_features for w in weights), **stacked)


def check_shape(kind: str, shape: tuple[int, ...]) -> str | None:
    """None if a weight of `shape` [out, in] can be held as `kind`, else why (a sentence)."""
    if kind not in QUANT_KINDS:
        return f"unknown quant kind {kind!r}; supported: {', '.join(QUANT_KINDS)}."
    if len(shape) != 2 or min(shape) < 1:
        return f"a quantized weight is [out_features, in_features]; got shape {tuple(shape)}."
    if shape[1] % BLOCK[kind]:
        return f"{kind} needs in_features a multiple of {BLOCK[kind]}; got {shape[1]}."
    return None


def _require_shape(kind: str, shape: tuple[int, ...]) -> None:
    if (reason := check_shape(kind, shape)) is not None:
        raise ValueError(reason)


# -- bit plumbing ------------------------------------------------------------------
def _nibbles(b: torch.Tensor, run: int) -> torch.Tensor:
    """Runs of `run` bytes, each holding `run` codes in its low nibbles then `run` in its high
    ones: [..., m] uint8 -> [..., 2m] codes in element order."""
    r = b.reshape(*b.shape[:-1], b.shape[-1] // run, 1, run)
    return torch.cat([r & 0x0F, r >> 4], dim=-2).reshape(*b.shape[:-1], 2 * b.shape[-1])


def _pack_nibbles(codes: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] codes 0..15 -> uint8 [N, K/2] split by half-group (the inverse of _nibbles)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // group, 2, group // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def _pack_bits(values: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[N, K] values below 2**bits -> int32 [N, K/group]: element e of a group at bit bits*e.
    (group * bits == 32; built byte by byte, little-endian, to keep temporaries small.)"""
    n, k = values.shape
    per_byte = 8 // bits
    v = values.to(torch.uint8).reshape(n, k // group, 4, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=v.device)
    packed = (v << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is an OR
    return packed.view(torch.int32).reshape(n, k // group)


def _unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _pack_bits: int32 [N, K/group] -> uint8 [N, K]."""
    n = packed.shape[0]
    b = packed.contiguous().view(torch.uint8).unsqueeze(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)
    return ((b >> shifts) & ((1 << bits) - 1)).reshape(n, -1)


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte `offset` of every block: [N, nb, T] -> f16 [N, nb]."""
    return b[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins: [N, nb, 12] -> two uint8 [N, nb, 8]."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return scales, mins


def _k_scale_bytes(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The inverse of _k_scales: two [..., 8] values 0..63 -> uint8 [..., 12]."""
    sc, mn = scales.to(torch.uint8), mins.to(torch.uint8)
    lo = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return torch.cat([lo, mid, hi], dim=-1)


# -- GGUF -> planar ----------------------------------------------------------------
def pack_gguf(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """GGUF blocks as a QuantWeight on raw's device.

    raw: uint8 [out, bytes_per_row] as GGUFTensor.data (any shape of that many bytes);
    qtype: one of GGUF_KINDS; shape: (out_features, in_features).
    """
    if qtype not in GGUF_KINDS:
        raise ValueError(f"pack_gguf takes {', '.join(GGUF_KINDS)}; got {qtype!r}")
    shape = (int(shape[0]), int(shape[1]))
    _require_shape(qtype, shape)
    out, inp = shape
    size = 32 if qtype in ("Q4_0", "Q4_1", "Q8_0") else QK_K
    nbytes = out * inp // size * GGUF_BLOCK_BYTES[qtype]
    if raw.dtype != torch.uint8 or raw.numel() != nbytes:
        raise ValueError(
            f"{qtype} {shape} needs {nbytes} uint8 bytes; got {raw.numel()} {raw.dtype}"
        )
    b = raw.reshape(out, inp // size, GGUF_BLOCK_BYTES[qtype])
    qw = QuantWeight(qtype, out, inp, qs=b.new_empty(0), scales=b.new_empty(0))
    if qtype == "Q4_0":  # d | 16 bytes of codes, already split by half-block
        return replace(qw, qs=b[..., 2:].reshape(out, -1).contiguous(), scales=_f16(b, 0))
    if qtype == "Q4_1":  # d | m | 16 bytes of codes
        qs = b[..., 4:].reshape(out, -1).contiguous()
        return replace(qw, qs=qs, scales=_f16(b, 0), mins=_f16(b, 2))
    if qtype == "Q8_0":  # d | 32 x int8
        qs = b[..., 2:].reshape(out, -1).contiguous().view(torch.int8)
        return replace(qw, qs=qs, scales=_f16(b, 0))
    d = _f16(b, 0 if qtype != "Q6_K" else 208)
    if qtype == "Q6_K":
        # 128 bytes of low nibbles (runs of 64) | 64 bytes of 2-bit highs | 16 x int8 | d
        low = _nibbles(b[..., :128], 64)
        # byte 32c + i holds, at bits 2s, the highs of element 128c + 32s + i
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(4, 1)
        high = (b[..., 128:192].reshape(out, -1, 2, 1, 32) >> shifts) & 3
        codes = (low | (high.reshape(low.shape) << 4)).reshape(out, inp)
        return replace(
            qw,
            qs=_pack_nibbles(codes & 0x0F, 16),
            qh=_pack_bits(codes >> 4, 2, 16),
            scales=b[..., 192:208].reshape(out, -1).contiguous().view(torch.int8),
            d=d,
        )
    # Q4_K, Q5_K: d | dmin | 12 bytes of scales/mins | (Q5_K: 32 bytes of highs) | 128 bytes
    # of nibbles in runs of 32
    scales, mins = _k_scales(b[..., 4:16])
    codes = _nibbles(b[..., -128:], 32)
    qh = None
    if qtype == "Q5_K":  # bit j of byte i is the high bit of element 32j + i
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(8, 1)
        high = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1
        qh = _pack_bits(high.reshape(out, inp), 1, 32)
    return replace(
        qw,
        qs=_pack_nibbles(codes.reshape(out, inp), 32),
        qh=qh,
        scales=scales.reshape(out, -1).contiguous(),
        mins=mins.reshape(out, -1).contiguous(),
        d=d,
        dmin=_f16(b, 2),
    )


# -- pre-quantized checkpoints -> planar ---------------------------------------------
def pack_zero_point(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> QuantWeight:
    """4-bit codes with a scale and an integer zero point per group, w = s * (q - z), as an
    "int4_zp" QuantWeight on their device (AWQ and GPTQ weights, unpacked by the loader).

    codes: [N, K] of 0..15; scales: [N, K/G] (dtype kept); zeros: [N, K/G] integers 0..16;
    G = K / scales.shape[1], a multiple of 32.
    """
    n, k = codes.shape
    groups = scales.shape[1]
    if k % groups or (k // groups) % 32 or scales.shape != zeros.shape or scales.shape[0] != n:
        raise ValueError(
            f"codes {list(codes.shape)} need scales and zeros [N, K/G] with G a multiple of 32; "
            f"got {list(scales.shape)} and {list(zeros.shape)}"
        )
    per = k // groups // 32  # the kernels' groups of 32 in one of the file's groups
    return QuantWeight(
        "int4_zp", n, k,
        qs=_pack_nibbles(codes, 32),
        scales=scales.repeat_interleave(per, dim=1).contiguous(),
        mins=zeros.to(torch.uint8).repeat_interleave(per, dim=1).contiguous(),
    )  # fmt: skip


def pack_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> QuantWeight:
    """An fp8 weight with one scale per block, w = e4m3(q) * scale[i // bn, j // bk], as an
    "fp8_block" QuantWeight on its device (an fp8 checkpoint's `weight_scale_inv`).

    q: [N, K] float8_e4m3fn (or its bits as uint8); scale: [ceil(N/bn), ceil(K/bk)] of any float
    dtype (held as f32); block: (bn, bk), bk a multiple of 32.
    """
    n, k = q.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if bk % 32 or tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 [{n}, {k}] in blocks of {list(block)} needs bk a multiple of 32 and scales "
            f"{list(want)}; got {list(scale.shape)}"
        )
    _require_shape("fp8_block", (n, k))
    per_row = scale.float().repeat_interleave(bn, dim=0)[:n]
    group_block = torch.arange(0, k, 32, device=q.device) // bk  # the block of each group of 32
    return QuantWeight(
        "fp8_block", n, k,
        qs=q.contiguous().view(torch.uint8),
        scales=per_row[:, group_block].contiguous(),
    )  # fmt: skip


# -- float -> int8 / int4 / fp8 (and the pre-quantized kinds, for tests) ---------------
def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """A float [out, in] weight quantized on its device: "int8" (symmetric, one fp32 scale per
    output channel), "int4" (asymmetric groups of 32: fp16 scale and min, w ~ scale*q + min,
    that is zero point -min/scale) or "fp8" (e4m3, one fp32 scale per output channel); or as a
    checkpoint would hold it: "int4_zp" (groups of 32 whose range takes in 0: fp16 scale,
    integer zero point) or "fp8_block" (e4m3 in 128 x 128 blocks, an fp32 scale each)."""
    if kind not in ("int8", "int4", "fp8", "int4_zp", "fp8_block"):
        raise ValueError(f"quantize makes int8, int4 or fp8 (or int4_zp, fp8_block); got {kind!r}")
    _require_shape(kind, tuple(w.shape))
    out, inp = w.shape
    w = w.float()
    if kind == "int4_zp":
        g = w.reshape(out, inp // 32, 32)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).half()
        s = scale.float().clamp_min(1e-30)[..., None]
        zero = (-lo[..., None] / s).round_().clamp_(0, 15)
        q = (g / s + zero).round_().clamp_(0, 15).reshape(out, inp)
        return pack_zero_point(q, scale, zero.squeeze(-1))
    if kind == "fp8_block":
        nb, kb = -(-out // 128), -(-inp // 128)
        padded = w.new_zeros(nb * 128, kb * 128)
        padded[:out, :inp] = w
        amax = padded.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp_min(1e-30)
        s = scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
        q = (w / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return pack_fp8_blocks(q, scale, (128, 128))
    if kind == "int4":
        g = w.reshape(out, inp // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        # quantize against the fp16 scale and min that will be held
        scale, low = ((hi - lo) / 15).half(), lo.half()
        q = (g - low.float()[..., None]) / scale.float().clamp_min(1e-30)[..., None]
        qs = _pack_nibbles(q.round_().clamp_(0, 15).reshape(out, inp), 32)
        return QuantWeight("int4", out, inp, qs=qs, scales=scale, mins=low)
    top = 127.0 if kind == "int8" else FP8_MAX
    scale = w.abs().amax(1) / top
    q = w / scale.clamp_min(1e-30)[:, None]
    if kind == "int8":
        qs = q.round_().clamp_(-127, 127).to(torch.int8)
    else:
        qs = q.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantWeight(kind, out, inp, qs=qs, scales=scale)


# -- planar -> float ---------------------------------------------------------------
def _codes(qw: QuantWeight) -> torch.Tensor:
    """Every element's code (low nibble and high bits together): uint8 [N, K]."""
    n, group = qw.out_features, GROUP[qw.kind]
    codes = _nibbles(qw.qs, group // 2)
    if qw.kind == "Q5_K":
        codes |= _unpack_bits(qw.qh, 1) << 4
    elif qw.kind == "Q6_K":
        codes |= _unpack_bits(qw.qh, 2) << 4
    return codes.reshape(n, -1)


def naive_dequantize(qw: QuantWeight) -> torch.Tensor:
    """The weight as float32 [out, in], in plain torch, with GGUF's arithmetic (exact)."""
    n, k, kind = qw.out_features, qw.in_features, qw.kind
    if kind == "int8":
        return qw.qs.float() * qw.scales.float()[:, None]
    if kind == "fp8":
        return qw.qs.view(torch.float8_e4m3fn).float() * qw.scales.float()[:, None]
    if kind == "fp8_block":
        s = qw.scales.float().repeat_interleave(GROUP[kind], dim=1)
        return qw.qs.view(torch.float8_e4m3fn).float() * s
    group = GROUP[kind]
    if kind == "Q8_0":
        q = qw.qs.float().reshape(n, -1, group)
    else:
        q = _codes(qw).float().reshape(n, -1, group)
    s = qw.scales.float()[..., None]
    if kind == "Q4_0":
        w = q.sub_(8).mul_(s)
    elif kind in ("Q4_1", "int4"):
        w = q.mul_(s).add_(qw.mins.float()[..., None])
    elif kind == "int4_zp":
        w = q.sub_(qw.mins.float()[..., None]).mul_(s)
    elif kind == "Q8_0":
        w = q.mul_(s)
    else:  # k-quants: one d (and dmin) per 256 weights, 256 // group groups
        per = QK_K // group
        d = qw.d.float().repeat_interleave(per, dim=1)[..., None]
        if kind == "Q6_K":
            w = q.sub_(32).mul_(d * s)
        else:
            dmin = qw.dmin.float().repeat_interleave(per, dim=1)[..., None]
            w = q.mul_(d * s).sub_(dmin * qw.mins.float()[..., None])
    return w.reshape(n, k)


# -- random GGUF tensors -----------------------------------------------------------
def make_gguf_blocks(
    qtype: str,
    out: int,
    inp: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Random but valid GGUF blocks, uint8 [out, bytes_per_row]: random codes, finite fp16
    scales chosen so that the weights have mean ~0 and std ~0.02 (a trained LLM's scale).

    Made on the generator's device (else `device`), returned on `device`.
    """
    if qtype not in GGUF_KINDS:
        raise ValueError(f"make_gguf_blocks takes {', '.join(GGUF_KINDS)}; got {qtype!r}")
    _require_shape(qtype, (out, inp))
    on = generator.device if generator is not None else torch.device(device)
    size = 32 if qtype in ("Q4_0", "Q4_1", "Q8_0") else QK_K
    nb = out * inp // size

    def rand_bytes(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (nb, count), dtype=torch.uint8, generator=generator, device=on)

    def rand_ints(lo: int, hi: int, count: int) -> torch.Tensor:
        return torch.randint(lo, hi, (nb, count), generator=generator, device=on)

    def f16(base: float) -> torch.Tensor:
        """One fp16 per block: base * U(0.75, 1.25)."""
        u = torch.rand(nb, 1, generator=generator, device=on)
        return f16_bytes(base * (0.75 + 0.5 * u))

    def f16_bytes(v: torch.Tensor) -> torch.Tensor:
        return v.half().view(torch.uint8)

    # the weights' std is ~ d * std(q) (* mean |scale| for the k-quants); uniform codes of b
    # bits have std (2^b)/sqrt(12)
    if qtype == "Q4_0":
        parts = [f16(0.02 / 4.6), rand_bytes(16)]
    elif qtype == "Q4_1":  # m = -7.5 d centres the codes' mean 7.5
        d = f16(0.02 / 4.6)
        m = f16_bytes(-7.5 * d.view(torch.float16).float())
        parts = [d, m, rand_bytes(16)]
    elif qtype == "Q8_0":
        parts = [f16(0.02 / 73.9), rand_bytes(32)]
    elif qtype in ("Q4_K", "Q5_K"):
        half_range = 7.5 if qtype == "Q4_K" else 15.5  # the codes' mean
        std_q = 4.6 if qtype == "Q4_K" else 9.2
        d = f16(0.02 / (47.5 * std_q))  # scales uniform in 32..63
        dmin = f16_bytes(d.view(torch.float16).float() * (half_range + 1))
        sc = rand_ints(32, 64, 8)
        # each sub-block's min cancels its mean: dmin*mn ~ d*sc*half_range
        ratio = d.view(torch.float16).float() / dmin.view(torch.float16).float()
        mn = (sc * half_range * ratio).round().clamp(0, 63)
        highs = [rand_bytes(32)] if qtype == "Q5_K" else []
        parts = [d, dmin, _k_scale_bytes(sc, mn), *highs, rand_bytes(128)]
    else:  # Q6_K: codes 0..63 less 32, int8 scales of either sign, |sc| in 48..127
        sign = rand_ints(0, 2, 16) * 2 - 1
        sc = (sign * rand_ints(48, 128, 16)).to(torch.int8).view(torch.uint8)
        parts = [rand_bytes(128), rand_bytes(64), sc, f16(0.02 / (88 * 18.5))]
    blocks = torch.cat(parts, dim=1)
    return blocks.reshape(out, -1).to(device)


def gguf_nbytes(qtype: str, shape: tuple[int, int]) -> int:
    """Bytes a GGUF tensor of `qtype` and `shape` takes."""
    size = 32 if qtype in ("Q4_0", "Q4_1", "Q8_0") else QK_K
    return math.prod(shape) // size * GGUF_BLOCK_BYTES[qtype]
