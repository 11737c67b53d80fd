"""A quantized weight dequantized whole into a float buffer, and the dense prefill path on it.

Past a few hundred rows a GEMM is compute-bound, and the fused `_quant_gemm_kernel`
(quant_matmul.py), which dequantizes each tile in registers before its dots, measured a
quarter of bf16 F.linear's TFLOP/s on an H100. `dense_quant_matmul` instead writes W once into
a float scratch buffer (`triton_dequantize`: 2 bytes a weight written in bf16, under 1 read)
and hands it to F.linear (cuBLAS). That costs a fixed time a call, about a 256-row bf16 GEMM's,
so it pays from a few hundred rows on (DENSE_MIN_M, the dispatcher's threshold).

The scratch: one flat buffer per (device, dtype), kept across calls and grown to the largest
weight seen, never allocated per call; at most DENSE_SCRATCH_MAX_BYTES (256 MiB). A weight
larger than that is dequantized and multiplied in row chunks that fit, so the cap bounds the
memory (Qwen3-8B: its largest layer weight, a fused gate/up 24576 x 4096, is 192 MiB in bf16;
its lm_head, 151936 x 4096 or 1.2 GB, would run in 5 chunks, and sees only a step's last rows
anyway). Calls on one device share it, so they must be ordered on one stream (the engine's
loop is), and none may run inside CUDA-graph capture (asserted): the dispatcher sends a
captured call to the fused kernels whatever its rows (decode graphs go up to 512 rows).

`triton_dequantize` equals quant_pack's `naive_dequantize` exactly in fp32, and its rounding
(to nearest even) in bf16 and fp16. It decodes with quant_matmul's `_codes` and `_affine`.
Every kind compiles for sm_90 to vector loads of the codes and 16-byte stores, without
register spills (checked with Triton's compiler and ptxas, without a GPU); its tiles and
DENSE_MIN_M are yet to be tuned on one.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from .quant_pack import GROUP, QuantWeight, naive_dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None

# Rows from which quant_matmul takes the dense path on the Triton backend. Estimated, not
# measured: at Qwen3-8B's 4096 -> 12288 in Q4_K the dequantize moves ~130 MB (~40 µs at
# 3.3 TB/s) and a 256-row bf16 GEMM takes ~37 µs at 700 TFLOP/s, so the dense path would run
# at ~half of bf16's rate at 256 rows and ~80% at 1024, where the fused GEMM ran at a quarter.
# To be tuned on a GPU with bench/quant_prefill.py.
DENSE_MIN_M = 256
DENSE_SCRATCH_MAX_BYTES = 256 << 20
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

if triton is not None:
    from .quant_matmul import DECODE, _affine, _codes

    @triton.jit
    def _dequantize_kernel(
        qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, out_ptr,
        N, K, num_groups, stride_qs, stride_qh, stride_s, stride_d, stride_o,
        KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """out[n-block, k-block] = W's [BLOCK_N, BLOCK_G * GROUP] tile: its codes loaded as
        contiguous bytes, decoded as [rows, groups, half-group] low and high halves, then
        interleaved back into element order for one contiguous store a row."""
        HALF: tl.constexpr = GROUP // 2
        BLOCK_K: tl.constexpr = BLOCK_G * GROUP
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = offs_n.to(tl.int64)[:, None, None]  # (row, group, position)
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[None, :, None]
        j = tl.arange(0, HALF)[None, None, :]
        mask = n_ok[:, None, None] & (g < num_groups)
        lo, hi = _codes(qs_ptr + rows * stride_qs, qh_ptr + rows * stride_qh, g, j, mask,
                        KIND, GROUP)  # fmt: skip
        s_row, m_row = s_ptr + rows * stride_s, m_ptr + rows * stride_s
        if KIND == "int4_zp":
            # s * (q - z), as naive's: _affine's s*q - s*z rounds twice for an fp32 s
            s = tl.load(s_row + g, mask=mask, other=0).to(tl.float32)
            z = tl.load(m_row + g, mask=mask, other=0).to(tl.float32)
            lo, hi = (lo - z) * s, (hi - z) * s
        else:
            a, b = _affine(s_row, m_row, d_ptr + rows * stride_d, dmin_ptr + rows * stride_d,
                           g, mask, KIND, GROUP)  # fmt: skip
            # every product is exact in fp32 (quant_pack's doc), so a * q + b rounds once, as
            # naive_dequantize's arithmetic does, fused or not
            lo, hi = lo * a + b, hi * a + b
        if KIND == "int8" or KIND == "fp8":  # per output channel; fp8's code is value / 256
            c = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
            if KIND == "fp8":
                c = c * 256.0
            lo, hi = lo * c[:, None, None], hi * c[:, None, None]
        w = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [rows, groups, half, position]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        if out_ptr.dtype.element_ty == tl.bfloat16:
            # round to nearest even by integer ops: Triton's interpreter truncates fp32 to
            # bf16, and this way both round alike (the weights are finite)
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            w = w.to(out_ptr.dtype.element_ty)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        out = out_ptr + offs_n.to(tl.int64)[:, None] * stride_o + offs_k[None, :]
        tl.store(out, w, mask=n_ok[:, None] & (offs_k < K)[None, :])


def triton_dequantize(
    qw: QuantWeight,
    out: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_n: int = 16,
    block_k: int = 256,
) -> torch.Tensor:
    """naive_dequantize in Triton, written into `out` [N, K] (bf16, fp16 or fp32, rows
    contiguous; None: a new one of `dtype`) -> out. block_k counts weights, a multiple of
    the kind's group (32; 16 for Q6_K); the tiles are to be tuned on a GPU."""
    if triton is None:
        raise RuntimeError("triton_dequantize needs triton, which is not installed")
    n, k, group = qw.out_features, qw.in_features, GROUP[qw.kind]
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qw.device)
    if tuple(out.shape) != (n, k) or out.dtype not in OUT_DTYPES or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{n}, {k}] bf16, fp16 or fp32 with contiguous rows; got "
            f"{list(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if block_k % group:
        raise ValueError(f"block_k {block_k} is not a multiple of {qw.kind}'s {group}")
    qs = qw.qs
    qh, mins, d, dmin = (t if t is not None else qs for t in (qw.qh, qw.mins, qw.d, qw.dmin))
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        qs, qh, qw.scales, mins, d, dmin, out,
        n, k, k // group, qs.stride(0), qh.stride(0), qw.scales.stride(0), d.stride(0),
        out.stride(0),
        KIND=DECODE[qw.kind], GROUP=group, BLOCK_N=block_n, BLOCK_G=block_k // group,
        num_warps=4,
    )  # fmt: skip
    return out


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first `numel` elements of the (device, dtype) scratch, grown to hold them."""
    key = (torch.device(device), dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        # the old buffer goes first, so the caching allocator may reuse its memory
        _scratch.pop(key, None)
        buf = None
        _scratch[key] = buf = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def scratch_bytes() -> int:
    """Bytes the dense path's scratch buffers hold, over every device and dtype."""
    return sum(buf.nbytes for buf in _scratch.values())


def capturing(x: torch.Tensor) -> bool:
    """Whether x's call would be recorded into a CUDA graph (the dense path must not be)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _rows(qw: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Output channels start..stop as a weight of their own (views: every tensor is per row)."""
    return replace(qw.map(lambda t: t[start:stop]), out_features=stop - start)


def dense_quant_matmul(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """As naive_quant_matmul: x [M, K] (any leading dims; bf16, fp16 or fp32) @ W.T (+ bias
    [N]) -> [M, N] in x.dtype, by dequantizing W into the scratch (in x.dtype) and F.linear.
    Not CUDA-graph safe (the scratch may grow): prefill only."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes {qw.in_features}")
    if x.dtype not in OUT_DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32; got {x.dtype}")
    assert not capturing(x), (
        "dense_quant_matmul inside CUDA-graph capture: its scratch would live in the graph's pool"
    )
    n, k = qw.out_features, qw.in_features
    lead = x.shape[:-1]
    x = x.reshape(-1, k)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    # balanced row chunks of at most DENSE_SCRATCH_MAX_BYTES each (one, as a rule)
    max_rows = max(1, DENSE_SCRATCH_MAX_BYTES // (k * x.element_size()))
    num_chunks = math.ceil(n / max_rows)
    rows = math.ceil(n / num_chunks)
    buf = scratch(rows * k, x.dtype, x.device)
    if num_chunks == 1:
        w = triton_dequantize(qw, buf.view(n, k))
        return F.linear(x, w, bias).reshape(*lead, n)
    y = x.new_empty(x.shape[0], n)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = triton_dequantize(_rows(qw, start, stop), buf[: (stop - start) * k].view(-1, k))
        y[:, start:stop] = F.linear(x, w, None if bias is None else bias[start:stop])
    return y.reshape(*lead, n)


__all__ = [
    "DENSE_MIN_M",
    "DENSE_SCRATCH_MAX_BYTES",
    "dense_quant_matmul",
    "naive_dequantize",
    "scratch_bytes",
    "triton_dequantize",
]
