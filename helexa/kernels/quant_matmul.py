"""y = x @ W.T (+ bias) with W held quantized (GGUF blocks, int8, int4, fp8, and pre-quantized
checkpoints' int4_zp and fp8_block) and dequantized in registers, never in memory. Layouts are
quant_pack's (`QuantWeight`); this module re-exports its API.

Two Triton kernels, one per regime, each parametrized by a constexpr KIND that picks the decode
(`_code_bits`/`_codes`: the codes of a tile's low and high half-groups; `_affine`: each
group's a, b with w = a * code + b):
- `_quant_gemv_kernel` for a few rows (decode, M <= GEMV_MAX_M), after llama.cpp's MMVQ: each
  program owns a few rows of W (4 or 8 at Qwen3-8B's shapes: >= 1000 programs) and walks all
  of K, so there is no split-K and nothing runs after it: it writes the output in x's dtype,
  bias added. A step's tiles are [rows, groups, runs, 8]: each thread loads 8 contiguous code
  bytes (16 4-bit codes) and, for each row of x, the 16 columns of x beside them, in the same
  layout (no shuffles or shared memory between them; the per-group scales and high bits are
  loaded in that layout too, `_per_group`), sums code * x over them in its own registers and
  applies the group's a (and b * Σ x, for the kinds with a b) once per group.
  Codes become fp32 by integer adds into a float's mantissa (`_exact_f32`: full rate, where
  int-to-float conversions run at a quarter), Q4_0's, Q6_K's and int4_zp's already centred on
  their zero points. Its fp32 accumulator keeps a sum per (row, group, run, row of x) and is
  reduced across threads once, after the loop;
- `_quant_gemm_kernel` for more rows (prefill): [BLOCK_M, BLOCK_N] output tiles; each K step
  dequantizes W's [BLOCK_K, BLOCK_N] tile in registers as its low and high half-groups (two
  [BLOCK_K/2, BLOCK_N], each beside a run of x's columns), casts them to x's dtype and
  tl.dot's them into an fp32 accumulator (bf16/fp16 tensor cores; fp32 x: 3xTF32). Its
  split-K programs write fp32 partials, summed afterwards.
No host syncs: the grid and every choice come from shapes (and the GPU's SM count), so both are
CUDA-graph safe. Checked with Triton's compiler and ptxas for sm_90, without a GPU: every GEMM
tile plan compiles without register spills at bf16 and fp16, and the GEMV for every kind at
M = 1..8, bf16, fp16 and fp32 x, at Qwen3-8B's shapes, in <= 128 registers (171 at fp32 x,
M = 8), no spills, and no shared memory or barrier inside its loop.

Speeds are unmeasured; GEMV_MAX_M, GEMV_RUNS and the tiles are yet to be tuned on a GPU
(bench/kernels.py). By count, the GEMV's compiled loop (sm_90) issues 7-8 instructions a weight
for the 8-bit kinds at M = 1, 8-11 for the 4- to 6-bit ones, ~15 for Q4_K at M = 2 and ~43 at
M = 8. An H200 issues ~31e12 a second, so the 8-bit kinds may reach memory speed at M = 1 but
the 4-bit ones top out near 35-50% of it, and from M = 2-4 the GEMM's tensor cores (a fixed
cost a weight, whatever M) likely win. The next step for 4 bits is fewer instructions a code
(MMVQ quantizes x to int8 for dp4a; Marlin decodes two codes an instruction into f16 pairs).
"""

from __future__ import annotations

import functools

import torch

from .quant_pack import (
    BLOCK,
    GGUF_KINDS,
    GROUP,
    QK_K,
    QUANT_KINDS,
    QuantWeight,
    cat_rows,
    check_shape,
    gguf_nbytes,
    make_gguf_blocks,
    naive_dequantize,
    pack_fp8_blocks,
    pack_gguf,
    pack_zero_point,
    quantize,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None

# Rows up to which the GEMV kernel runs: issue 36 asks 1..8 of it. It spends M fp32 FMAs a
# weight where the GEMM's tensor cores spend none, and by instruction count (module doc) the
# GEMM should win from 2-4 rows at 4 bits: to be tuned on a GPU with bench/kernels.py (its
# [gemm] rows), as are GEMV_RUNS and _plan's tiles.
GEMV_MAX_M = 8
# Runs of 8 positions of W's half-groups (8 bytes of 4-bit codes) a GEMV step holds, for 3 or
# more rows of x: one a thread at 8 warps (~64-128 registers on sm_90), two for 1 or 2 rows
GEMV_RUNS = 256
# the kernels' decode: int4 is held as Q4_1
DECODE = {kind: "Q4_1" if kind == "int4" else kind for kind in QUANT_KINDS}


def naive_quant_matmul(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (any leading dims) @ dequantized W [N, K].T (+ bias [N]) in plain torch, in
    fp32, -> [M, N] in x.dtype. Dequantizes the whole weight every call: a reference."""
    w = naive_dequantize(qw)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def unsupported_reason(kind: str, device: torch.device | str) -> str | None:
    """None if quant_matmul runs `kind` on `device`, else why (a sentence).

    On CUDA that is the Triton kernels (every kind, fp8 included: its e4m3 bits are decoded by
    integer ops, no fp8 hardware needed); elsewhere naive_quant_matmul, correct but slow.
    """
    if kind not in QUANT_KINDS:
        return f"unknown quant kind {kind!r}; supported: {', '.join(QUANT_KINDS)}."
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if triton is None:
        return "quantized weights on CUDA need triton, which is not installed."
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return (
            f"the quantized kernels need compute capability 8.0 or later (bf16 tensor-core "
            f"dots); this GPU has {major}.{minor}."
        )
    return None


if triton is not None:

    @triton.jit
    def _code_bits(qs_row, qh_row, g, j, mask, KIND: tl.constexpr, GROUP: tl.constexpr):
        """(lo, hi): the codes of elements g*GROUP + j and g*GROUP + GROUP/2 + j of the rows
        whose pointers are qs_row and qh_row, as integers (fp8: fp16, its value / 256, which
        the epilogue's scale puts back); everything broadcasts to the tile's shape."""
        HALF: tl.constexpr = GROUP // 2
        if KIND == "Q8_0" or KIND == "int8" or KIND == "fp8" or KIND == "fp8_block":  # bytes
            lo = tl.load(qs_row + g * GROUP + j, mask=mask, other=0)
            hi = tl.load(qs_row + g * GROUP + HALF + j, mask=mask, other=0)
        else:  # two 4-bit codes per byte, split by half-group
            b = tl.load(qs_row + g * HALF + j, mask=mask, other=0).to(tl.int32)
            lo, hi = b & 0xF, b >> 4
        if KIND == "Q5_K":  # one high bit per weight: bit e of the group's int32
            h = tl.load(qh_row + g, mask=mask, other=0)
            lo |= ((h >> j) & 1) << 4
            hi |= ((h >> (j + HALF)) & 1) << 4
        if KIND == "Q6_K":  # two high bits per weight: bits 2e and 2e+1
            h = tl.load(qh_row + g, mask=mask, other=0)
            lo |= ((h >> (2 * j)) & 3) << 4
            hi |= ((h >> (2 * j + GROUP)) & 3) << 4
        if KIND == "fp8" or KIND == "fp8_block":
            # e4m3 -> fp16 by moving its bits (exponent bias 7 -> 15, subnormals to
            # subnormals), which divides the value by 2^(15-7)
            lo, hi = lo.to(tl.uint16), hi.to(tl.uint16)
            lo = (((lo & 0x7F) << 7) | ((lo & 0x80) << 8)).to(tl.float16, bitcast=True)
            hi = (((hi & 0x7F) << 7) | ((hi & 0x80) << 8)).to(tl.float16, bitcast=True)
        return lo, hi

    @triton.jit
    def _codes(qs_row, qh_row, g, j, mask, KIND: tl.constexpr, GROUP: tl.constexpr):
        """_code_bits' codes as fp32."""
        lo, hi = _code_bits(qs_row, qh_row, g, j, mask, KIND, GROUP)
        return lo.to(tl.float32), hi.to(tl.float32)

    @triton.jit
    def _affine(s_row, m_row, d_row, dmin_row, g, mask, KIND: tl.constexpr, GROUP: tl.constexpr):
        """(a, b) of group g: its weights are a * code + b. int8 and fp8: (1, 0), their
        per-channel scale is applied to the accumulator."""
        if KIND == "int8" or KIND == "fp8":
            a, b = 1.0, 0.0
        else:
            s = tl.load(s_row + g, mask=mask, other=0).to(tl.float32)
            if KIND == "fp8_block":  # its code is the e4m3 value / 256 (_codes)
                a, b = s * 256.0, 0.0
            elif KIND == "int4_zp":  # s * (q - z): z*s is exact in fp32 for an f16/bf16 s
                a = s
                b = -tl.load(m_row + g, mask=mask, other=0).to(tl.float32) * s
            elif KIND == "Q4_0":
                a, b = s, -8.0 * s
            elif KIND == "Q4_1":
                a, b = s, tl.load(m_row + g, mask=mask, other=0).to(tl.float32)
            elif KIND == "Q8_0":
                a, b = s, 0.0
            else:  # k-quants: d (and dmin) per super-block of 256 weights
                sb = g // (256 // GROUP)
                a = tl.load(d_row + sb, mask=mask, other=0).to(tl.float32) * s
                if KIND == "Q6_K":
                    b = -32.0 * a
                else:
                    mn = tl.load(m_row + g, mask=mask, other=0).to(tl.float32)
                    b = -tl.load(dmin_row + sb, mask=mask, other=0).to(tl.float32) * mn
        return a, b

    @triton.jit
    def _epilogue(
        acc, offs_m, offs_n, M, N, split, s_ptr, bias_ptr, out_ptr, stride_os, stride_om,
        KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        """out[split, m, n] = acc (* per-channel scale) (+ bias: only without split-K)."""
        n_ok = offs_n < N
        if KIND == "int8" or KIND == "fp8":
            scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
            if KIND == "fp8":
                scale = scale * 256.0
            acc = acc * scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
        mask = (offs_m < M)[:, None] & n_ok[None, :]
        tl.store(out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _exact_f32(q, zero):
        """q - zero as fp32, exactly, for integer codes q and zero points (|q|, |zero| < 2^21):
        q added to the bits of 1.5 * 2^23 puts it in the mantissa, and one fp32 subtraction
        takes both off. An integer and an fp32 add, both full rate on a GPU, where converting
        int to float runs at a quarter of it."""
        return (q.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - (12582912.0 + zero)

    @triton.jit
    def _per_group(row, idx, mask, RUNS: tl.constexpr):
        """row[idx] as fp32, a [rows, groups, RUNS, 1] tile. Its indices are clamped, not
        masked, and repeated over the runs: with no run of addresses along the groups left
        to coalesce, the compiler loads it in the layout of the codes it scales, where a
        plain load gets a layout of its own and shared memory and barriers to convert it
        every step."""
        runs = tl.zeros([1, 1, RUNS, 1], dtype=tl.int32)
        return tl.load(row + (tl.where(mask, idx, 0) + runs)).to(tl.float32)

    @triton.jit
    def _gemv_group(
        qs_row, qh_row, s_row, m_row, d_row, dmin_row, g, j, mask,
        KIND: tl.constexpr, GROUP: tl.constexpr, RUNS: tl.constexpr,
    ):  # fmt: skip
        """(lo, hi, a, b) for groups g: the low and high half-group codes as exact fp32, and
        a and b, per group, with w = a * code + b. Q4_0's, Q6_K's and int4_zp's codes come
        centred on their zero points (q - 8, q - 32, q - z), so their b is 0; so is Q8_0's,
        fp8_block's, int8's and fp8's (a = 1 for these two: their per-channel scale is the
        epilogue's). Only Q4_1 (int4), Q4_K and Q5_K have a b."""
        if KIND == "Q5_K" or KIND == "Q6_K":
            lo, hi = _code_bits(qs_row, qh_row, g, j, mask, "Q4_0", GROUP)  # the low nibbles
            # the group's high bits, as _per_group loads (and for the same reason)
            h = tl.load(qh_row + (tl.where(mask, g, 0) + 0 * j))
            if KIND == "Q5_K":  # one high bit per weight: bit e of the group's int32
                lo |= ((h >> j) & 1) << 4
                hi |= ((h >> (j + GROUP // 2)) & 1) << 4
            else:  # two: bits 2e and 2e+1
                lo |= ((h >> (2 * j)) & 3) << 4
                hi |= ((h >> (2 * j + GROUP)) & 3) << 4
        else:
            lo, hi = _code_bits(qs_row, qh_row, g, j, mask, KIND, GROUP)
        a, b = 1.0, 0.0
        if KIND == "fp8" or KIND == "fp8_block":
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
            if KIND == "fp8_block":  # its code is the e4m3 value / 256
                a = _per_group(s_row, g, mask, RUNS) * 256.0
        elif KIND == "int8":
            lo, hi = _exact_f32(lo, 0.0), _exact_f32(hi, 0.0)
        else:
            zero = 0.0
            if KIND == "Q4_0":
                zero = 8.0
            elif KIND == "Q6_K":
                zero = 32.0
            elif KIND == "int4_zp":
                zero = _per_group(m_row, g, mask, RUNS)
            lo, hi = _exact_f32(lo, zero), _exact_f32(hi, zero)
            a = _per_group(s_row, g, mask, RUNS)
            if KIND == "Q4_1":
                b = _per_group(m_row, g, mask, RUNS)
            elif KIND == "Q4_K" or KIND == "Q5_K" or KIND == "Q6_K":  # d per super-block
                sb = g // (256 // GROUP)
                a = _per_group(d_row, sb, mask, RUNS) * a
                if KIND != "Q6_K":
                    b = -_per_group(dmin_row, sb, mask, RUNS) * _per_group(m_row, g, mask, RUNS)
        return lo, hi, a, b

    @triton.jit
    def _quant_gemv_kernel(
        x_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, bias_ptr, out_ptr,
        M, N, num_groups,
        stride_xm, stride_qs, stride_qh, stride_s, stride_d, stride_om,
        KIND: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """out[:M, n-block] = x @ W[n-block].T (+ bias), in x's dtype: the program owns
        BLOCK_N rows of W and walks all of K, BLOCK_G groups a step. A step's tiles are
        [rows, groups, runs, 8]: each thread holds one run of 8 positions of a half-group, its
        codes and, for each row of x, x's 16 columns beside them (low and high halves), so
        Σ code * x over the run is summed in its own registers, then scaled by the group's a
        (and b * Σ x added) once. The fp32 accumulator [rows, groups, runs, BLOCK_M] keeps one
        sum per row of x in each thread; it is reduced across threads once, after the loop."""
        HALF: tl.constexpr = GROUP // 2
        RUNS: tl.constexpr = HALF // 8
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past N read row N-1 again (no mask on their loads); the store drops them
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None, None, None]
        qs_row, qh_row = qs_ptr + rows * stride_qs, qh_ptr + rows * stride_qh
        s_row, m_row = s_ptr + rows * stride_s, m_ptr + rows * stride_s
        d_row, dmin_row = d_ptr + rows * stride_d, dmin_ptr + rows * stride_d
        # position j = 8 * run + t of each half-group: (row, group, run, t)
        j = (tl.arange(0, RUNS) * 8)[None, None, :, None] + tl.arange(0, 8)[None, None, None, :]
        m_of = tl.arange(0, BLOCK_M)[None, None, None, :]  # the accumulator's last axis
        acc = tl.zeros([BLOCK_N, BLOCK_G, RUNS, BLOCK_M], dtype=tl.float32)
        for g0 in range(0, num_groups, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)[None, :, None, None]
            g_ok = g < num_groups
            lo, hi, a, b = _gemv_group(
                qs_row, qh_row, s_row, m_row, d_row, dmin_row, g, j, g_ok, KIND, GROUP, RUNS
            )
            # the low halves' x columns, as a tile of the codes' shape: loaded so, x lands in
            # the codes' layout, each thread beside its codes (the rows' repeats are cache hits)
            k = tl.broadcast_to(g * GROUP + j, [BLOCK_N, BLOCK_G, RUNS, 8])
            for m in tl.static_range(BLOCK_M):
                # rows of x past M read row M-1 again; the store drops them
                x_m = x_ptr + tl.minimum(M - 1, m) * stride_xm + k
                x_lo = tl.load(x_m, mask=g_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(x_m + HALF, mask=g_ok, other=0.0).to(tl.float32)
                part = tl.sum(lo * x_lo + hi * x_hi, axis=3, keep_dims=True)
                if KIND != "int8" and KIND != "fp8":
                    part = a * part
                if KIND == "Q4_1" or KIND == "Q4_K" or KIND == "Q5_K":
                    part += b * tl.sum(x_lo + x_hi, axis=3, keep_dims=True)
                acc = tl.where(m_of == m, acc + part, acc)
        y = tl.trans(tl.sum(tl.sum(acc, axis=2), axis=1))  # [BLOCK_M, BLOCK_N]
        _epilogue(
            y, tl.arange(0, BLOCK_M), offs_n, M, N, 0, s_ptr, bias_ptr, out_ptr, 0, stride_om,
            KIND, HAS_BIAS,
        )  # fmt: skip

    @triton.jit
    def _quant_gemm_kernel(
        x_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dmin_ptr, bias_ptr, out_ptr,
        M, N, num_groups, groups_per_split,
        stride_xm, stride_qs, stride_qh, stride_s, stride_d, stride_os, stride_om,
        KIND: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_M, BLOCK_N] tile of out for one split of K. Each step dequantizes W's
        [BLOCK_K, BLOCK_N] tile as [groups, half-group, BLOCK_N] (a and b loaded once per group
        and column), then its low and high half-groups flattened to two [BLOCK_K/2, BLOCK_N]."""
        HALF: tl.constexpr = GROUP // 2
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        split = tl.program_id(2)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = (offs_n < N)[None, None, :]  # (group, position, n)
        rows = offs_n.to(tl.int64)[None, None, :]
        qs_row, qh_row = qs_ptr + rows * stride_qs, qh_ptr + rows * stride_qh
        s_row, m_row = s_ptr + rows * stride_s, m_ptr + rows * stride_s
        d_row, dmin_row = d_ptr + rows * stride_d, dmin_ptr + rows * stride_d
        j = tl.arange(0, HALF)[None, :, None]
        t = tl.arange(0, BLOCK_K // 2)  # the flattened (group, position) of a half
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        g_first = split * groups_per_split
        g_end = tl.minimum(g_first + groups_per_split, num_groups)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g0 in range(g_first, g_end, GROUPS):
            g = g0 + tl.arange(0, GROUPS)[:, None, None]
            mask = n_ok & (g < g_end)
            lo, hi = _codes(qs_row, qh_row, g, j, mask, KIND, GROUP)
            a, b = _affine(s_row, m_row, d_row, dmin_row, g, mask, KIND, GROUP)
            lo = (lo * a + b).reshape(BLOCK_K // 2, BLOCK_N)
            hi = (hi * a + b).reshape(BLOCK_K // 2, BLOCK_N)
            g_t = g0 + t // HALF
            k = (g_t * GROUP + t % HALF)[None, :]  # the low halves' x columns
            x_ok = m_ok[:, None] & (g_t < g_end)[None, :]
            x_lo = tl.load(x_rows + k, mask=x_ok, other=0.0)
            x_hi = tl.load(x_rows + k + HALF, mask=x_ok, other=0.0)
            if UPCAST:  # Triton's interpreter dots 16-bit floats as raw bits (3.9)
                x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            else:
                lo, hi = lo.to(x_ptr.dtype.element_ty), hi.to(x_ptr.dtype.element_ty)
            acc = tl.dot(x_lo, lo, acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, hi, acc, input_precision=PRECISION)
        _epilogue(
            acc, offs_m, offs_n, M, N, split, s_ptr, bias_ptr, out_ptr, stride_os, stride_om,
            KIND, HAS_BIAS,
        )  # fmt: skip


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: any small number keeps the plan the same shape
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(programs: int, num_groups: int, block_g: int, device: torch.device) -> int:
    """Splits of K that bring the programs to ~2 per SM, each at least 4 steps long."""
    want = -(-2 * _num_sms(device) // programs)
    return max(1, min(want, num_groups // (4 * block_g), 16))


def _gemv_plan(m: int, n: int, num_groups: int, group: int, device: torch.device, given) -> dict:
    """Tiles of the GEMV: every row of x in one program, BLOCK_N rows of W a program (as many
    as leave >= 4 programs an SM: 4096 rows on 132 SMs take 4 a program, 1024 programs), and
    as many groups a step as make GEMV_RUNS runs of 8 positions. It never splits K."""
    if m > 16:  # its accumulator holds every row
        raise ValueError(f"the GEMV kernel takes at most 16 rows; got {m}")
    block_m = given.get("block_m") or triton.next_power_of_2(m)
    if block_m < m:
        raise ValueError(f"the GEMV kernel holds every row of x: block_m {block_m} < {m} rows")
    block_n = given.get("block_n")
    if block_n is None:
        block_n = next((b for b in (8, 4, 2) if n >= 4 * _num_sms(device) * b), 1)
    runs = max(1, group // 16)  # runs of 8 positions a half-group
    if given.get("block_k"):
        block_g = given["block_k"] // group
    else:
        step = GEMV_RUNS * (2 if block_m <= 2 else 1)
        block_g = min(max(1, step // (block_n * runs)), triton.next_power_of_2(num_groups))
    warps = max(1, min(8, block_n * block_g * runs // 32))
    return {
        "gemv": True, "block_m": block_m, "block_n": block_n, "block_g": block_g,
        "block_k": block_g * group, "split_k": 1, "num_warps": warps, "num_stages": 2,
    }  # fmt: skip


def _plan(
    m: int, n: int, k: int, kind: str, dtype: torch.dtype, device: torch.device, **given
) -> dict:
    """Kernel, tiles and split-K for an [m, k] @ [n, k].T; `given` overrides any of them."""
    group = GROUP[kind]
    num_groups = k // group
    block_k = given.get("block_k")
    if block_k is not None and (block_k < group or block_k % group):
        raise ValueError(f"block_k {block_k} is not a multiple of {kind}'s {group}")
    gemv = given.get("gemv")
    if m <= GEMV_MAX_M if gemv is None else gemv:
        return _gemv_plan(m, n, num_groups, group, device, given)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if dtype == torch.float32:  # its 3xTF32 dots spill past 64 x 64 (sm_90)
        block_m = min(block_m, 64)
    plan = {"block_m": block_m, "block_n": 64 if block_m <= 64 else 128, "block_k": 64}
    plan.update({key: v for key, v in given.items() if v is not None})
    programs = triton.cdiv(m, plan["block_m"]) * triton.cdiv(n, plan["block_n"])
    block_g = plan["block_k"] // group
    if plan["block_k"] < 32:  # two dots of block_k/2, and tl.dot takes K >= 16
        raise ValueError(f"the GEMM kernel needs block_k >= 32; got {plan['block_k']}")
    split = plan.get("split_k") or _split_k(programs, num_groups, block_g, device)
    # whole steps per split, and no split left empty
    per_split = triton.cdiv(triton.cdiv(num_groups, split), block_g) * block_g
    plan.update(
        gemv=False, block_g=block_g, per_split=per_split,
        split_k=triton.cdiv(num_groups, per_split),
        num_warps=8 if plan["block_m"] * plan["block_n"] >= 128 * 128 else 4, num_stages=3,
    )  # fmt: skip
    return plan


def _precision(x: torch.Tensor) -> str:
    """tl.dot's input_precision. fp32 x: fp32-accurate dots, to match torch to ~1e-6: 3xTF32
    on a GPU (tensor cores; "ieee" dots spill registers there), plain fp32 in the interpreter.
    16-bit x: ignored (bf16/fp16 tensor-core dots)."""
    if x.dtype != torch.float32:
        return "tf32"
    return "tf32x3" if x.is_cuda else "ieee"


def _weight_args(qw: QuantWeight) -> tuple:
    """The kernels' weight pointers (qs standing in for the tensors a kind lacks)."""
    qs = qw.qs
    qh, mins, d, dmin = (t if t is not None else qs for t in (qw.qh, qw.mins, qw.d, qw.dmin))
    return qs, qh, qw.scales, mins, d, dmin


def _launch_gemv(x, qw: QuantWeight, bias, plan: dict) -> torch.Tensor:
    """One launch, which writes the output (bias added, in x's dtype): nothing runs after."""
    m, n = x.shape[0], qw.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    qs, qh, scales, mins, d, dmin = _weight_args(qw)
    grid = (triton.cdiv(n, plan["block_n"]),)
    _quant_gemv_kernel[grid](
        x, qs, qh, scales, mins, d, dmin, bias if bias is not None else qs, out,
        m, n, qw.in_features // GROUP[qw.kind],
        x.stride(0), qs.stride(0), qh.stride(0), scales.stride(0), d.stride(0), out.stride(0),
        KIND=DECODE[qw.kind], GROUP=GROUP[qw.kind], HAS_BIAS=bias is not None,
        BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], BLOCK_G=plan["block_g"],
        num_warps=plan["num_warps"], num_stages=plan["num_stages"],
    )  # fmt: skip
    return out


def _launch(x, qw: QuantWeight, bias, plan: dict) -> torch.Tensor:
    if plan["gemv"]:
        return _launch_gemv(x, qw, bias, plan)
    m, n = x.shape[0], qw.out_features
    split, group = plan["split_k"], GROUP[qw.kind]
    out = torch.empty(
        (split, m, n) if split > 1 else (1, m, n),
        dtype=torch.float32 if split > 1 else x.dtype,
        device=x.device,
    )
    qs, qh, scales, mins, d, dmin = _weight_args(qw)
    grid = (triton.cdiv(m, plan["block_m"]), triton.cdiv(n, plan["block_n"]), split)
    _quant_gemm_kernel[grid](
        x, qs, qh, scales, mins, d, dmin, bias if split == 1 and bias is not None else qs, out,
        m, n, qw.in_features // group, plan["per_split"],
        x.stride(0), qs.stride(0), qh.stride(0), scales.stride(0), d.stride(0),
        out.stride(0), out.stride(1),
        KIND=DECODE[qw.kind], GROUP=group, HAS_BIAS=split == 1 and bias is not None,
        PRECISION=_precision(x), UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,
        BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"],
        num_warps=plan["num_warps"], num_stages=plan["num_stages"],
    )  # fmt: skip
    if split == 1:
        return out[0]
    y = out.sum(0)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def triton_quant_matmul(
    x: torch.Tensor,
    qw: QuantWeight,
    bias: torch.Tensor | None = None,
    *,
    gemv: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """As naive_quant_matmul, in Triton: x [M, K] (any leading dims; bf16, fp16 or fp32) @
    W.T (+ bias [N]) -> [M, N] in x.dtype, W dequantized in registers, accumulated in fp32.

    The keywords override the plan (tests: small tiles run faster in Triton's interpreter):
    gemv picks the kernel (default: M <= GEMV_MAX_M), block_k counts weights and must be a
    multiple of the kind's group (32; 16 for Q6_K), split_k splits K in the GEMM (default: to
    fill the GPU); the GEMV never splits K and ignores it.
    """
    if triton is None:
        raise RuntimeError(
            "triton_quant_matmul needs triton, which is not installed; use naive_quant_matmul"
        )
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes {qw.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32; got {x.dtype}")
    lead = x.shape[:-1]
    x = x.reshape(-1, qw.in_features)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] == 0:
        return x.new_empty(*lead, qw.out_features)
    plan = _plan(
        x.shape[0], qw.out_features, qw.in_features, qw.kind, x.dtype, x.device,
        gemv=gemv, block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
    )  # fmt: skip
    return _launch(x, qw, bias, plan).reshape(*lead, qw.out_features)


__all__ = [
    "BLOCK",
    "GEMV_MAX_M",
    "GGUF_KINDS",
    "GROUP",
    "QK_K",
    "QUANT_KINDS",
    "QuantWeight",
    "cat_rows",
    "check_shape",
    "gguf_nbytes",
    "make_gguf_blocks",
    "naive_dequantize",
    "naive_quant_matmul",
    "pack_fp8_blocks",
    "pack_gguf",
    "pack_zero_point",
    "quantize",
    "triton_quant_matmul",
    "unsupported_reason",
]
