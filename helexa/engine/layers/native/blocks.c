/* GGUF block matmuls for the CPU: y[M, N] = x[M, K] @ W[N, K]^T, W held as the file holds
 * it (rows of Q4_0, Q4_1 or Q8_0 blocks of 32 weights; or, rows in 8s, the same bytes with
 * 8 rows interleaved: "x8" below), x quantized per block of 32 to int8
 * (a scale d and, for Q4_1, s = d * sum(q)) as llama.cpp's vec_dot_q4_1_q8_1 does: each
 * block's dot is then one integer multiply-add of 32 bytes (AVX2 maddubs) and two scalars.
 *
 *   Q4_0  [d f16][16 B]        w = d * (q - 8)      q: byte j = weight j (low nibble),
 *   Q4_1  [d f16][m f16][16 B] w = d * q + m           weight j + 16 (high nibble)
 *   Q8_0  [d f16][32 x i8]     w = d * q
 *
 * Built at first use by helexa/engine/layers/native.py with the system C compiler
 * (-O3 -march=native -fopenmp) and loaded with ctypes; the OpenMP runtime is torch's own,
 * already in the process. Threads split the output rows. The scalar loops under #else are
 * the reference and the path for CPUs without AVX2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "common.h"

/* the K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks), in kquants.c: every entry point
 * below hands those kinds over */
int hx_kq_is_kind(int kind);
int hx_kq_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                 float *y, int num_threads);
int hx_kq_matmul_f32(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x,
                     int64_t M, float *y, int num_threads);
int hx_kq_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                     int num_threads);
int hx_kq_dequantize_t(int kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                       int num_threads);
int hx_kq_rows(int kind, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n,
               float *out);

enum { QK = 32, KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2, MT = 4 };
/* The same blocks with 8 rows interleaved (native.interleave; see "x8" below). */
enum { KIND_Q4_0X8 = 3, KIND_Q4_1X8 = 4, KIND_Q8_0X8 = 5, KIND_LAST = 5, XR = 8 };
/* How far ahead the x8 kernel asks for its weights. A decode step streams every weight from
 * memory once, in calls of 0.2-28 MB each split over the threads. On the 2-vCPU EPYC,
 * weights cold, one row (bench/native_blocks.py): a SmolLM2 layer's four matmuls ~113 ->
 * ~105 us and the Q8_0 lm_head ~930 -> ~850 us at 2-4 KB (6 KB no better); at 4 rows all
 * within noise. In decode steps (bench/decode_step.py): lm_head 1.00 -> 0.90 ms, the layers
 * unchanged. */
enum { PREFETCH = 4096 };
static inline int is_x8(int kind) { return kind >= KIND_Q4_0X8; }
static inline int base_kind(int kind) { return is_x8(kind) ? kind - KIND_Q4_0X8 : kind; }


/* float -> IEEE half, rounded to nearest even as F16C's vcvtps2ph and torch's .half() round:
 * above the largest half (65504, up to where rounding stays below 65520) it is inf, NaN
 * stays NaN, and below 2^-14 the result is subnormal, rounded by the FPU itself (adding a
 * magic number whose last mantissa bit is worth the smallest half subnormal). */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) /* >= 65536, inf or NaN */
        return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (x < 0x38800000u) { /* < 2^-14: a subnormal half, or zero */
        const uint32_t magic = 126u << 23; /* 0.5: its mantissa's last bit is 2^-24 */
        float fx, fm;
        memcpy(&fx, &x, 4);
        memcpy(&fm, &magic, 4);
        fx += fm;
        memcpy(&x, &fx, 4);
        return (uint16_t)(sign | (x - magic));
    }
    uint32_t odd = (x >> 13) & 1; /* ties to even: round half up, less one when even */
    x += 0xc8000fffu + odd;      /* rebias the exponent (-112 << 23) and round the mantissa */
    return (uint16_t)(sign | (x >> 13)); /* 65504 < f < 65536 rounds up to inf here */
}

/* A layer's KV cache holds float32 values (f16 = 0) or IEEE halves (f16 = 1): half the bytes
 * a decode step reads, as llama.cpp's default cache does. Reads widen to float32; writes
 * round to nearest even. The helpers take `f16` as a constant of an inlined caller, so each
 * loop compiles for one element type. */
static inline float kv_get(const void *c, int64_t i, int f16) {
    return f16 ? f16_to_f32(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}
static inline const void *kv_at(const void *c, int64_t i, int f16) {
    return (const char *)c + i * (f16 ? 2 : 4);
}
/* n floats of x into elements [i, i + n) of cache c */
static void kv_put(void *c, int64_t i, const float *x, int64_t n, int f16) {
    if (!f16) {
        memcpy((float *)c + i, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *o = (uint16_t *)c + i;
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(o + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) o[j] = f32_to_f16(x[j]);
}

#ifdef __AVX2__
/* elements [i, i + 8) of cache row p, as floats */
static inline __m256 kv_load8(const void *p, int64_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}
#endif

/* bytes of one row's block: the file's, and an x8 kind's share of its group's */
int hx_block_bytes(int kind) {
    kind = base_kind(kind);
    return kind == KIND_Q4_0 ? 18 : kind == KIND_Q4_1 ? 20 : 34;
}

/* A block's parts: its scale d, its offset m (w = d q + m: Q4_1's own, -8 d for Q4_0, none
 * for Q8_0) and its codes. */
static inline float block_d(const uint8_t *blk) { return f16_to_f32(*(const uint16_t *)blk); }
static inline float block_m(int kind, const uint8_t *blk, float d) {
    return kind == KIND_Q4_1 ? f16_to_f32(*(const uint16_t *)(blk + 2))
           : kind == KIND_Q4_0 ? -8.f * d
                               : 0.f;
}
static inline const uint8_t *block_qs(int kind, const uint8_t *blk) {
    return blk + (kind == KIND_Q4_1 ? 4 : 2);
}

/* the block's 32 weights as floats, GGUF's arithmetic (what native.dequantize computes) */
static inline void dequant_block(int kind, const uint8_t *blk, float *o) {
    float d = block_d(blk);
    if (kind == KIND_Q8_0) {
        const int8_t *qs = (const int8_t *)block_qs(kind, blk);
        for (int j = 0; j < QK; j++) o[j] = (float)qs[j] * d;
        return;
    }
    const uint8_t *qs = block_qs(kind, blk);
    float m = block_m(kind, blk, d);
    for (int j = 0; j < 16; j++) {
        o[j] = (float)(qs[j] & 0x0f) * d + m;
        o[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

/* x [M, K] -> q [M, K] int8, d [M, K/32] and s [M, K/32] (d * the block's sum of q). The
 * AVX2 path rounds as lrintf does (to nearest even, the default mode), so both give the same
 * bytes; it replaced a scalar loop of fmaxf and lrintf calls that took ~10% of a 16-row
 * decode step on one thread while the other waited. */
static void quantize_x(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t i = 0; i < M * nb; i++) {
        const float *v = x + i * QK;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 a[4], amax8 = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(v + 8 * j);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, a[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float di = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i qi[4], sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], _mm256_set1_ps(inv)));
            sum = _mm256_add_epi32(sum, qi[j]);
        }
        /* 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permute
         * puts them back */
        __m256i p16 = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p8 = _mm256_packs_epi16(p16, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i * QK), p8);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        d[i] = di;
        s[i] = di * (float)_mm_cvtsi128_si32(s4);
#else
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        float di = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int qj = (int)lrintf(v[j] * inv);
            q[i * QK + j] = (int8_t)qj;
            sum += qj;
        }
        d[i] = di;
        s[i] = di * (float)sum;
#endif
    }
}

#ifdef __AVX2__

/* An empty asm that claims to change v: the compiler must have v in a register here, so it
 * cannot sink the sum into one long chain after the block's 32 products. GCC 12 did that
 * to the x8 kernel's per-row integer sums (integer adds reassociate freely), keeping all
 * the products live and spilling ~20 of them to the stack each block. Pinning each sum
 * where it is made removed every spill: at 4-16 rows, ~25% less time for the Q4_1 x8
 * matmuls (bench/native_blocks.py). */
#define PIN(v) __asm__("" : "+x"(v))

/* the 32 weights of a Q4 block as bytes 0..15, in order */
static inline __m256i unpack_q4(const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* sum over the block of u8 w times s8 x, as 8 floats */
static inline __m256 dot_u8s8(__m256i w, __m256i x) {
    __m256i p16 = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
#endif

/* rows [n0, n1) of W against the mt (<= MT) quantized rows of x starting at xq/xd/xs. Always
 * inlined into `rows_block`'s switch with kind and mt constant, so that each case compiles
 * to its own loop with the accumulators in registers. */
static inline __attribute__((always_inline)) void rows_kernel(
    const int kind, const int mt, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t n0,
    int64_t n1, const int8_t *xq, const float *xd, const float *xs, int64_t K, float *y,
    int64_t N) {
    const int bb = kind == KIND_Q4_0 ? 18 : kind == KIND_Q4_1 ? 20 : 34;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float out[MT] = {0};
#ifdef __AVX2__
        __m256 acc[MT];
        float extra[MT] = {0}; /* Q4_1: the sum of m * s */
        for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            const float dw = block_d(blk), mw = block_m(kind, blk, dw);
            __m256i wv, aw;
            if (kind == KIND_Q8_0) {
                wv = _mm256_loadu_si256((const __m256i *)block_qs(kind, blk));
                aw = _mm256_sign_epi8(wv, wv);
            } else {
                wv = aw = unpack_q4(block_qs(kind, blk));
            }
            for (int i = 0; i < mt; i++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
                if (kind == KIND_Q8_0) xv = _mm256_sign_epi8(xv, wv);
                __m256 p = dot_u8s8(aw, xv);
                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[i * nb + b]), acc[i]);
                if (kind != KIND_Q8_0) extra[i] += mw * xs[i * nb + b];
            }
        }
        for (int i = 0; i < mt; i++) out[i] = hsum8(acc[i]) + extra[i];
#else
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            float dw = block_d(blk), mw = block_m(kind, blk, dw);
            for (int i = 0; i < mt; i++) {
                const int8_t *xb = xq + i * K + b * QK;
                int sumi = 0;
                if (kind == KIND_Q8_0) {
                    const int8_t *qs = (const int8_t *)block_qs(kind, blk);
                    for (int j = 0; j < QK; j++) sumi += qs[j] * xb[j];
                    out[i] += dw * xd[i * nb + b] * (float)sumi;
                } else {
                    const uint8_t *qs = block_qs(kind, blk);
                    for (int j = 0; j < 16; j++)
                        sumi += (qs[j] & 0x0f) * xb[j] + (qs[j] >> 4) * xb[j + 16];
                    out[i] += dw * xd[i * nb + b] * (float)sumi + mw * xs[i * nb + b];
                }
            }
        }
#endif
        for (int i = 0; i < mt; i++) y[i * N + n] = out[i];
    }
}

#define ROWS_CASE(KIND, MT_)                                                                   \
    case KIND * 8 + MT_:                                                                       \
        rows_kernel(KIND, MT_, w, row_bytes, nb, n0, n1, xq, xd, xs, K, y, N);                 \
        break;
#define ROWS_KIND(KIND) ROWS_CASE(KIND, 1) ROWS_CASE(KIND, 2) ROWS_CASE(KIND, 3) ROWS_CASE(KIND, 4)

static void rows_block(int kind, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t n0,
                       int64_t n1, int mt, const int8_t *xq, const float *xd, const float *xs,
                       int64_t K, float *y, int64_t N) {
    switch (kind * 8 + mt) {
        ROWS_KIND(KIND_Q4_0)
        ROWS_KIND(KIND_Q4_1)
        ROWS_KIND(KIND_Q8_0)
    }
}

/* -- x8: the blocks of 8 rows side by side ------------------------------------------------
 * native.interleave stores a weight whose rows come in 8s (nearly all) as groups of 8 rows;
 * a group holds, block by block, its 8 rows' blocks as one "group block":
 *
 *   [d f16 x 8][m f16 x 8, Q4_1 only][codes: byte 32c + 4r + k = byte 4c + k of row r's block]
 *
 * (c < 4 for Q4, c < 8 for Q8_0). A 32-byte load of codes then holds 4 consecutive codes of
 * each of the 8 rows, one row per 32-bit lane: against 4 activations broadcast to every lane,
 * maddubs leaves each row's partial dot in its own lane, so a block's 8 dots come out as one
 * vector (no horizontal sums), its 8 scales load and widen at once (F16C), and the unpacked
 * codes serve up to MT activation rows. The bytes are the file's, reordered. */
static inline int codes_at(int base) { return base == KIND_Q4_1 ? 32 : 16; }

/* row r's block as the file held it, from its group block */
static inline void group_row(int base, const uint8_t *g, int r, uint8_t *blk) {
    memcpy(blk, g + 2 * r, 2);
    if (base == KIND_Q4_1) memcpy(blk + 2, g + 2 * XR + 2 * r, 2);
    uint8_t *out = (uint8_t *)block_qs(base, blk);
    const uint8_t *qs = g + codes_at(base);
    for (int c = 0; c < (base == KIND_Q8_0 ? 8 : 4); c++) memcpy(out + 4 * c, qs + 32 * c + 4 * r, 4);
}

#ifdef __AVX2__
/* v[p] (lane r: row r's weight at position p) → v[r] (lane p: the same), in place */
static inline void transpose8(__m256 v[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

/* a group's 8 rows as floats, out[r * K + j] (GGUF's arithmetic, as dequant_block: q d is
 * exact in float32, so one rounding at most, the same with or without FMA). With AVX2, eight
 * positions of the 8 rows widened side by side (a row a lane), then transposed so that each
 * row's eight floats store together; block by block and row by row it took 0.75 ms for
 * Q4_1's 3072 x 576 gate/up, ~57 ms of every prompt chunk over SmolLM2's layers. */
static void group_unpack(int base, const uint8_t *grp, int64_t nb, float *out, int64_t K) {
    const int64_t gb = XR * hx_block_bytes(base);
#ifdef __AVX2__
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * gb, *qs = blk + codes_at(base);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        float *o = out + b * QK;
        __m256 v[8];
        if (base == KIND_Q8_0) {
            for (int c = 0; c < 8; c += 2) { /* positions 4c … 4c + 7 */
                for (int p = 0; p < 8; p++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c + p / 4)));
                    __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * (p % 4)), 24);
                    v[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dv);
                }
                transpose8(v);
                for (int r = 0; r < XR; r++) _mm256_storeu_ps(o + r * K + 4 * c, v[r]);
            }
            continue;
        }
        const __m256 mv = base == KIND_Q4_1
                              ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * XR)))
                              : _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
        for (int half = 0; half < 2; half++)      /* low nibbles: 0 … 15; high: 16 … 31 */
            for (int c = 0; c < 4; c += 2) {       /* positions 16 half + 4c … + 7 */
                for (int p = 0; p < 8; p++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c + p / 4)));
                    __m256i q = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * (p % 4) + 4 * half), low);
                    v[p] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), dv), mv);
                }
                transpose8(v);
                for (int r = 0; r < XR; r++) _mm256_storeu_ps(o + r * K + 16 * half + 4 * c, v[r]);
            }
    }
#else
    uint8_t blk[34];
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < XR; r++) {
            group_row(base, grp + b * gb, r, blk);
            dequant_block(base, blk, out + r * K + b * QK);
        }
#endif
}

/* one block of a group's 8 rows, transposed: out[j * N + r] = row r's weight j (out: the
 * block's first position, the group's first row). Eight rows widened side by side (a row a
 * lane) are already the eight floats that store together there: no transpose. */
static void group_block_t(int base, const uint8_t *blk, float *out, int64_t N) {
#ifdef __AVX2__
    const uint8_t *qs = blk + codes_at(base);
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    if (base == KIND_Q8_0) {
        for (int c = 0; c < 8; c++) { /* positions 4c … 4c + 3 */
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            for (int p = 0; p < 4; p++) {
                __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * p), 24);
                _mm256_storeu_ps(out + (4 * c + p) * N, _mm256_mul_ps(_mm256_cvtepi32_ps(q), dv));
            }
        }
        return;
    }
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256 mv = base == KIND_Q4_1
                          ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * XR)))
                          : _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
    for (int c = 0; c < 4; c++) { /* positions 4c … 4c + 3 (low nibbles), 16 + the same */
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        for (int p = 0; p < 8; p++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * (p % 4) + 4 * (p / 4)), low);
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), dv, mv);
            _mm256_storeu_ps(out + (16 * (p / 4) + 4 * c + p % 4) * N, v);
        }
    }
#else
    uint8_t one[34];
    float w[QK];
    for (int r = 0; r < XR; r++) {
        group_row(base, blk, r, one);
        dequant_block(base, one, w);
        for (int j = 0; j < QK; j++) out[j * N + r] = w[j];
    }
#endif
}

/* rows [8 g0, 8 g1) of an x8 weight against the mt (<= MT) quantized rows of x */
static inline __attribute__((always_inline)) void groups_kernel(
    const int base, const int mt, const uint8_t *w, int64_t nb, int64_t g0, int64_t g1,
    const int8_t *xq, const float *xd, const float *xs, int64_t K, float *y, int64_t N) {
    const int64_t gb = XR * (base == KIND_Q4_0 ? 18 : base == KIND_Q4_1 ? 20 : 34);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *grp = w + g * nb * gb;
#ifdef __AVX2__
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
        __m256 acc[MT];
        for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = grp + b * gb, *qs = blk + codes_at(base);
            /* the blocks PREFETCH bytes ahead on their way in (see PREFETCH) */
            for (int64_t o = 0; o < gb; o += 64)
                _mm_prefetch((const char *)blk + PREFETCH + o, _MM_HINT_T0);
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            __m256i isum[MT];
            for (int i = 0; i < mt; i++) isum[i] = _mm256_setzero_si256();
            if (base == KIND_Q8_0) {
                for (int c = 0; c < 8; c++) {
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    __m256i aw = _mm256_sign_epi8(wv, wv);
                    for (int i = 0; i < mt; i++) {
                        int32_t x4;
                        memcpy(&x4, xq + i * K + b * QK + 4 * c, 4);
                        __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(x4), wv);
                        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
                        isum[i] = _mm256_add_epi32(isum[i], p);
                        PIN(isum[i]);
                    }
                }
            } else {
                /* i16 sums: 8 products of (0..15) x (-127..127) pairs, |sum| <= 30480 */
                for (int c = 0; c < 4; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(raw, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int i = 0; i < mt; i++) {
                        int32_t xl, xh;
                        memcpy(&xl, xq + i * K + b * QK + 4 * c, 4);
                        memcpy(&xh, xq + i * K + b * QK + 16 + 4 * c, 4);
                        __m256i s = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
                        isum[i] = _mm256_add_epi16(isum[i], s);
                        PIN(isum[i]);
                    }
                }
                for (int i = 0; i < mt; i++) isum[i] = _mm256_madd_epi16(isum[i], ones);
            }
            __m256 mv = _mm256_setzero_ps();
            if (base == KIND_Q4_1)
                mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * XR)));
            else if (base == KIND_Q4_0)
                mv = _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
            for (int i = 0; i < mt; i++) {
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(xd[i * nb + b]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, acc[i]);
                if (base != KIND_Q8_0)
                    acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[i * nb + b]), acc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + i * N + g * XR, acc[i]);
#else
        float out[MT][XR] = {{0}};
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < XR; r++) {
                uint8_t blk[34];
                group_row(base, grp + b * gb, r, blk);
                const float d = block_d(blk), m = block_m(base, blk, d);
                for (int i = 0; i < mt; i++) {
                    const int8_t *xb = xq + i * K + b * QK;
                    int sumi = 0;
                    if (base == KIND_Q8_0) {
                        const int8_t *q = (const int8_t *)block_qs(base, blk);
                        for (int j = 0; j < QK; j++) sumi += q[j] * xb[j];
                    } else {
                        const uint8_t *q = block_qs(base, blk);
                        for (int j = 0; j < 16; j++)
                            sumi += (q[j] & 0x0f) * xb[j] + (q[j] >> 4) * xb[j + 16];
                    }
                    out[i][r] += (float)sumi * (d * xd[i * nb + b]);
                    if (base != KIND_Q8_0) out[i][r] += m * xs[i * nb + b];
                }
            }
        }
        for (int i = 0; i < mt; i++)
            for (int r = 0; r < XR; r++) y[i * N + g * XR + r] = out[i][r];
#endif
    }
}

#define GROUPS_CASE(KIND, MT_)                                                                 \
    case KIND * 8 + MT_:                                                                       \
        groups_kernel(KIND, MT_, w, nb, g0, g1, xq, xd, xs, K, y, N);                          \
        break;
#define GROUPS_KIND(KIND)                                                                      \
    GROUPS_CASE(KIND, 1) GROUPS_CASE(KIND, 2) GROUPS_CASE(KIND, 3) GROUPS_CASE(KIND, 4)

static void groups_block(int base, const uint8_t *w, int64_t nb, int64_t g0, int64_t g1, int mt,
                         const int8_t *xq, const float *xd, const float *xs, int64_t K, float *y,
                         int64_t N) {
    switch (base * 8 + mt) {
        GROUPS_KIND(KIND_Q4_0)
        GROUPS_KIND(KIND_Q4_1)
        GROUPS_KIND(KIND_Q8_0)
    }
}

#ifdef __AVX2__
/* rows [8 g0, 8 g1) of an x8 weight against mt (<= MT) float32 rows of x, exactly: per block
 * and 4 codes, the 8 rows' weights widened side by side (one row a lane) to w = d q + m, and
 * multiplied into one vector of 8 outputs per row of x. Two accumulators a row (the low and
 * high nibbles; even and odd codes of Q8_0), so that FMA latency is not the limit. Unpacking
 * each group to row-major floats and taking a dot product per output ran ~9 GFLOP/s. */
static inline __attribute__((always_inline)) void groups_f32_kernel(
    const int base, const int mt, const uint8_t *w, int64_t nb, int64_t g0, int64_t g1,
    const float *x, int64_t K, float *y, int64_t N) {
    const int64_t gb = XR * (base == KIND_Q4_0 ? 18 : base == KIND_Q4_1 ? 20 : 34);
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *grp = w + g * nb * gb;
        __m256 acc[MT], acc2[MT];
        for (int i = 0; i < mt; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = grp + b * gb, *qs = blk + codes_at(base);
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const float *xb = x + b * QK;
            if (base == KIND_Q8_0) {
                for (int c = 0; c < 8; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    for (int k = 0; k < 4; k += 2) { /* byte k of each lane, sign-extended */
                        __m256i q0 = _mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * k), 24);
                        __m256i q1 = _mm256_srai_epi32(_mm256_slli_epi32(raw, 16 - 8 * k), 24);
                        __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), dv);
                        __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(q1), dv);
                        for (int i = 0; i < mt; i++) {
                            const float *xi = xb + i * K + 4 * c + k;
                            acc[i] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xi), acc[i]);
                            acc2[i] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xi + 1), acc2[i]);
                        }
                    }
                }
            } else {
                __m256 mv = base == KIND_Q4_1
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * XR)))
                    : _mm256_mul_ps(dv, _mm256_set1_ps(-8.f)); /* Q4_0: d (q - 8) */
                for (int c = 0; c < 4; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    for (int k = 0; k < 4; k++) {
                        __m256i byte = _mm256_srli_epi32(raw, 8 * k);
                        __m256 wl = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(_mm256_and_si256(byte, low)), dv, mv);
                        __m256 wh = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(byte, 4), low)),
                            dv, mv);
                        for (int i = 0; i < mt; i++) {
                            const float *xi = xb + i * K + 4 * c + k;
                            acc[i] = _mm256_fmadd_ps(wl, _mm256_broadcast_ss(xi), acc[i]);
                            acc2[i] = _mm256_fmadd_ps(wh, _mm256_broadcast_ss(xi + 16), acc2[i]);
                        }
                    }
                }
            }
        }
        for (int i = 0; i < mt; i++)
            _mm256_storeu_ps(y + i * N + g * XR, _mm256_add_ps(acc[i], acc2[i]));
    }
}

#define GROUPS_F32_CASE(KIND, MT_)                                                             \
    case KIND * 8 + MT_:                                                                       \
        groups_f32_kernel(KIND, MT_, w, nb, g0, g1, x, K, y, N);                               \
        break;
#define GROUPS_F32_KIND(KIND)                                                                  \
    GROUPS_F32_CASE(KIND, 1) GROUPS_F32_CASE(KIND, 2) GROUPS_F32_CASE(KIND, 3)                 \
    GROUPS_F32_CASE(KIND, 4)

static void groups_f32_block(int base, const uint8_t *w, int64_t nb, int64_t g0, int64_t g1,
                             int mt, const float *x, int64_t K, float *y, int64_t N) {
    switch (base * 8 + mt) {
        GROUPS_F32_KIND(KIND_Q4_0)
        GROUPS_F32_KIND(KIND_Q4_1)
        GROUPS_F32_KIND(KIND_Q8_0)
    }
}
#endif

/* The x8 matmuls' tiling: groups of 8 rows in chunks of 2 (16 rows) split over the threads,
 * each chunk read once for up to MT rows of x. The int8 kernel on xq/xd/xs, or, with xq NULL,
 * the exact float32 one on x (AVX2 builds only: the scalar build unpacks groups instead). */
static void x8_tiles(int base, const uint8_t *w, int64_t N, int64_t nb, int64_t K, int64_t M,
                     const float *x, const int8_t *xq, const float *xd, const float *xs,
                     float *y, int num_threads) {
#ifndef __AVX2__
    (void)x; /* only AVX2 builds take the exact path through here */
#endif
    int64_t ng = N / XR, nchunks = (ng + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t g0 = 2 * c, g1 = g0 + 2 < ng ? g0 + 2 : ng;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = M - m0 < MT ? (int)(M - m0) : MT;
            if (xq)
                groups_block(base, w, nb, g0, g1, mt, xq + m0 * K, xd + m0 * nb, xs + m0 * nb, K,
                             y + m0 * N, N);
#ifdef __AVX2__
            else
                groups_f32_block(base, w, nb, g0, g1, mt, x + m0 * K, K, y + m0 * N, N);
#endif
        }
    }
}

/* y [M, N] = x [M, K] @ W^T; W: N rows of K/32 blocks of `kind`. Returns 0, or -1 on a bad
 * argument or a failed allocation. */
int hx_blocks_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                     float *y, int num_threads) {
    if (hx_kq_is_kind(kind)) return hx_kq_matmul(kind, w, N, K, x, M, y, num_threads);
    if (K % QK || M < 1 || N < 1 || kind < 0 || kind > KIND_LAST || (is_x8(kind) && N % XR))
        return -1;
    int64_t nb = K / QK, row_bytes = nb * hx_block_bytes(kind);
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc((size_t)(M * nb) * sizeof(float));
    float *xs = malloc((size_t)(M * nb) * sizeof(float));
    if (!xq || !xd || !xs) {
        free(xq); free(xd); free(xs);
        return -1;
    }
    quantize_x(x, M, K, xq, xd, xs);
    if (is_x8(kind)) {
        x8_tiles(base_kind(kind), w, N, nb, K, M, x, xq, xd, xs, y, num_threads);
        free(xq); free(xd); free(xs);
        return 0;
    }
    /* rows in chunks, so that each thread's share is contiguous and a chunk's weights are
       read once for up to MT rows of x */
    const int64_t chunk = 16;
    int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = M - m0 < MT ? (int)(M - m0) : MT;
            rows_block(kind, w, row_bytes, nb, n0, n1, mt, xq + m0 * K, xd + m0 * nb,
                       xs + m0 * nb, K, y + m0 * N, N);
        }
    }
    free(xq); free(xd); free(xs);
    return 0;
}

/* -- the rest of a decode step's small operations, as single calls ------------------------ */


/* y += a * x over n floats */
static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

/* one row's RMSNorm: o = x / sqrt(mean(x^2) + eps) * w (o may be x) */
static void norm_row(const float *x, const float *w, float *o, int64_t d, float eps) {
    float inv = 1.f / sqrtf(dot_f32(x, x, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++) o[i] = x[i] * inv * w[i];
}

/* RMSNorm of rows [rows, dim] in float32: out = x / sqrt(mean(x^2) + eps) * weight. With a
 * residual: x + residual is normalised and written to residual_out first (either may be
 * the same buffer as its input). Rows split over threads once there are enough of them (a
 * 1024-token prompt's [1024, 576] took 0.57 ms on one thread, 61 calls a prompt). */
int hx_rms_norm(const float *x, const float *residual, const float *weight, float *out,
                float *residual_out, int64_t rows, int64_t dim, float eps, int num_threads) {
    if (rows < 0 || dim < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        if (residual) {
            float *h = residual_out + r * dim;
            const float *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) h[i] = xr[i] + res[i];
            xr = h;
        }
        norm_row(xr, weight, o, dim, eps);
    }
    return 0;
}

#ifdef __AVX2__
/* e^x for x <= 0 (softmax after subtracting the max), ~1e-7 relative: Cephes' expf, 2^n
 * times a degree-6 polynomial of the remainder; below -87.3 (where expf underflows) it
 * returns e^-87.3 ~ 1e-38 rather than 0, which no softmax sum notices. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* s[t] = e^(s[t] - max s) over n scores; returns their sum */
static float softmax_exp(float *s, int64_t n) {
    float smax = -INFINITY, total = 0.f;
    int64_t t = 0;
    for (int64_t i = 0; i < n; i++) smax = s[i] > smax ? s[i] : smax;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(smax), acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum8(acc);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - smax);
        total += s[t];
    }
    return total;
}

/* the cache slot of a row's token t: block sizes are powers of two (the config says so,
 * and hx_paged_decode checks), so a shift and a mask rather than a 64-bit division */
#define SLOT(table, t) ((table[(t) >> shift] << shift) | ((t) & (block_size - 1)))

#ifdef __AVX2__
/* [a0 . 1, a1 . 1, a2 . 1, a3 . 1]: four vectors' sums */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

/* s[i * span_max + t - t0] = scale * q_i . k_t for the nh (1-3) query heads q_i (D apart)
 * that share kv head kvh, tokens t0 <= t < t1, k_t found through the block table. Four
 * tokens at a time where D allows, each key row loaded (and widened) once for all nh heads:
 * 4 x nh dot products accumulate side by side, one transposing reduction a head. Eight
 * tokens of one head at a time loaded every key once per head of its group, widening a
 * float16 cache's three times over. */
static inline __attribute__((always_inline)) void group_scores(
    const float *q, const int nh, const void *k_cache, int f16, const int64_t *table,
    int64_t block_size, int64_t KVH, int64_t kvh, int64_t D, int64_t t0, int64_t t1,
    float scale, float *s, int64_t span_max) {
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    int64_t t = t0;
#ifdef __AVX2__
    if (D % 8 == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (; t + 4 <= t1; t += 4) {
            const void *kp[4];
            for (int j = 0; j < 4; j++)
                kp[j] = kv_at(k_cache, (SLOT(table, t + j) * KVH + kvh) * D, f16);
            __m256 acc[3][4];
            for (int i = 0; i < nh; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < D; c += 8) {
                for (int j = 0; j < 4; j++) {
                    __m256 kc = kv_load8(kp[j], c, f16);
                    for (int i = 0; i < nh; i++)
                        acc[i][j] = _mm256_fmadd_ps(kc, _mm256_loadu_ps(q + i * D + c), acc[i][j]);
                }
            }
            for (int i = 0; i < nh; i++)
                _mm_storeu_ps(s + i * span_max + t - t0,
                              _mm_mul_ps(hsum4x8(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), sc));
        }
    }
#endif
    for (; t < t1; t++) {
        int64_t at = (SLOT(table, t) * KVH + kvh) * D;
        for (int i = 0; i < nh; i++) {
            float dot = 0.f;
            if (!f16) {
                dot = dot_f32(q + i * D, (const float *)k_cache + at, D);
            } else {
                for (int64_t c = 0; c < D; c++) dot += q[i * D + c] * kv_get(k_cache, at + c, 1);
            }
            s[i * span_max + t - t0] = dot * scale;
        }
    }
}

/* group_scores for every head of the task: each kv head's `group` query heads in sets of
 * up to three (12 accumulators, four keys' worth, in the 16 registers), nh a constant in
 * each call so that the kernel unrolls over it */
static inline __attribute__((always_inline)) void span_scores(
    const float *q, const void *k_cache, int f16, const int64_t *table, int64_t block_size,
    int64_t H, int64_t KVH, int64_t D, int64_t t0, int64_t t1, float scale, float *s,
    int64_t span_max) {
    const int64_t group = H / KVH;
    for (int64_t h = 0, nh; h < H; h += nh) {
        nh = group - h % group < 3 ? group - h % group : 3; /* the rest of h's kv head's */
        const float *qh = q + h * D;
        float *sh = s + h * span_max;
#define SCORES(NH) group_scores(qh, NH, k_cache, f16, table, block_size, KVH, h / group, D, \
                                t0, t1, scale, sh, span_max)
        if (nh == 3) SCORES(3);
        else if (nh == 2) SCORES(2);
        else SCORES(1);
#undef SCORES
    }
}

#ifdef __AVX2__
/* o [8 nv] = sum over tokens t0 <= t < t1 of p[t - t0] * v_t[d0 : d0 + 8 nv], nv <= 8 (a
 * constant where the caller can make it one, so that the loop over it unrolls) */
static inline __attribute__((always_inline)) void values_chunk(
    const float *p, const void *v_cache, int f16, const int64_t *table, int64_t block_size,
    int64_t KVH, int64_t kvh, int64_t D, int64_t d0, const int nv, int64_t t0, int64_t t1,
    float *o) {
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    __m256 acc[8];
    for (int j = 0; j < nv; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; t++) {
        const void *vr = kv_at(v_cache, SLOT(table, t) * KVH * D + kvh * D + d0, f16);
        __m256 pt = _mm256_set1_ps(p[t - t0]);
        for (int j = 0; j < nv; j++) acc[j] = _mm256_fmadd_ps(pt, kv_load8(vr, 8 * j, f16), acc[j]);
    }
    for (int j = 0; j < nv; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
}
#endif

/* o [D] = sum over tokens t0 <= t < t1 of p[t - t0] * v_t, v_t one kv head's value row found
 * through the block table: token by token with the output in registers, 64 dims at a time
 * (an axpy into memory per token and head loaded and stored the output each time; ~2x the
 * instructions) */
static inline __attribute__((always_inline)) void head_values(
    const float *p, const void *v_cache, int f16, const int64_t *table, int64_t block_size,
    int64_t KVH, int64_t kvh, int64_t D, int64_t t0, int64_t t1, float *o) {
#ifdef __AVX2__
    if (D % 8 == 0) {
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            if (D - d0 >= 64)
                values_chunk(p, v_cache, f16, table, block_size, KVH, kvh, D, d0, 8, t0, t1, o);
            else
                values_chunk(p, v_cache, f16, table, block_size, KVH, kvh, D, d0,
                             (int)((D - d0) / 8), t0, t1, o);
        }
        return;
    }
#endif
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
    for (int64_t t = t0; t < t1; t++) {
        int64_t at = SLOT(table, t) * KVH * D + kvh * D;
        for (int64_t d = 0; d < D; d++) o[d] += p[t - t0] * kv_get(v_cache, at + d, f16);
    }
}

/* one (row, span) task of hx_paged_decode, for one cache element type (see there) */
static inline __attribute__((always_inline)) void decode_span(
    const float *qi, const void *k_cache, const void *v_cache, int f16, const int64_t *table,
    int64_t block_size, int64_t H, int64_t KVH, int64_t D, int64_t t0, int64_t t1,
    float scale, float *s, int64_t span_max, float *part, int64_t S, int64_t sp,
    int64_t stride) {
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t group = H / KVH, nt = t1 - t0, row = KVH * D;
    for (int64_t t = t0; t < t1; t++) { /* the span's K, in the order it lies */
        const char *krow = kv_at(k_cache, SLOT(table, t) * row, f16);
        for (int64_t b = 0; b < row * (f16 ? 2 : 4); b += 64) __builtin_prefetch(krow + b, 0, 3);
    }
    span_scores(qi, k_cache, f16, table, block_size, H, KVH, D, t0, t1, scale, s, span_max);
    for (int64_t h = 0; h < H; h++) {
        float *pp = part + (h * S + sp) * stride, *sh = s + h * span_max;
        pp[D] = -INFINITY, pp[D + 1] = 0.f; /* an empty span weighs 0 in the merge */
        if (nt < 1) {
            memset(pp, 0, (size_t)D * sizeof(float));
            continue;
        }
        float m = -INFINITY;
        for (int64_t t = 0; t < nt; t++) m = sh[t] > m ? sh[t] : m;
        pp[D] = m, pp[D + 1] = softmax_exp(sh, nt);
        head_values(sh, v_cache, f16, table, block_size, KVH, h / group, D, t0, t1, pp);
    }
}

/* One decode step's attention over the paged cache, float32. q [n, H, D]; k_cache, v_cache
 * [num_blocks, block_size, KVH, D], float32 or (kv_f16) half; tables [n, max_blocks] int64
 * block ids; lens [n] the tokens each row attends to (its own included); out [n, H, D].
 *
 * Split-K ("flash decoding"): each row's context is cut into spans, and a task is one
 * (row, span) over every head. It prefetches the span's K as the cache lays it out (a
 * token's [KVH, D] rows after one another, a block's tokens after one another), scores it
 * a kv head's query heads together (span_scores), then weighs V into each head's output
 * held in registers (head_values). By (row, head) tasks over whole contexts, each head
 * read its kv head's 256 bytes out of every 768 and a 512-token context cost ~115-190 us a
 * layer against ~70-110 now (SmolLM2's 9 heads, 3 kv heads, 30 layers, the cache out of
 * the L3 as the streaming weights leave it in a decode step), and one row's 9 tasks left
 * a thread of 2 idle a ninth of the time. A task leaves, per head, its span's max score,
 * sum of e^(score - max) and unnormalised output; a second pass merges the spans.
 *
 * A row's span count comes from its own length and the thread count alone (8 spans a
 * thread, none under 16 tokens), never from the other rows: a row's floats then do not
 * depend on what it is batched with, so that a speculating sequence's check rows (several
 * rows of one sequence, each a token longer) compute exactly what its one-row decode steps
 * would, and greedy output stays the same with speculation on. When the count came from
 * the batch (8 tasks a thread over all rows), one row took 16 spans and five took 4, and
 * SmolLM2's code edit parted at its 34th token. Returns 0, or -1 on a bad argument or a
 * failed allocation. */
static int64_t decode_spans(int64_t len, int num_threads) {
    int64_t S = 8 * (int64_t)num_threads, most = (len + 15) / 16;
    return S > most ? (most > 0 ? most : 1) : S;
}

int hx_paged_decode(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D,
                    const void *k_cache, const void *v_cache, int kv_f16, int64_t block_size,
                    const int64_t *tables, int64_t max_blocks, const int32_t *lens, float scale,
                    float *out, int num_threads) {
    if (n < 1 || KVH < 1 || H % KVH || D < 1 || block_size < 1 || num_threads < 1) return -1;
    if (block_size & (block_size - 1)) return -1; /* a power of two */
    for (int64_t i = 0; i < n; i++)
        if (lens[i] < 1 || lens[i] > max_blocks * block_size) return -1;
    /* first[i]: row i's first task (its spans' partials lie from part + first[i] H stride) */
    int64_t *first = malloc((size_t)(n + 1) * sizeof(int64_t));
    if (!first) return -1;
    int64_t span_max = 1;
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t S = decode_spans(lens[i], num_threads), per = (lens[i] + S - 1) / S;
        first[i + 1] = first[i] + S;
        if (per > span_max) span_max = per;
    }
    const int64_t tasks = first[n], stride = D + 2; /* o[D], max, sum */
    float *part = malloc((size_t)(tasks * H * stride) * sizeof(float));
    int64_t *row_of = malloc((size_t)tasks * sizeof(int64_t));
    if (!part || !row_of) {
        free(part), free(row_of), free(first);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t t = first[i]; t < first[i + 1]; t++) row_of[t] = i;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *s = malloc((size_t)(H * span_max) * sizeof(float));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!s) continue;
            int64_t i = row_of[task], S = first[i + 1] - first[i], sp = task - first[i];
            int64_t len = lens[i], per = (len + S - 1) / S;
            int64_t t0 = sp * per, t1 = t0 + per < len ? t0 + per : len;
            const int64_t *table = tables + i * max_blocks;
            float *pi = part + first[i] * H * stride;
            if (kv_f16)
                decode_span(q + i * H * D, k_cache, v_cache, 1, table, block_size, H, KVH, D,
                            t0, t1, scale, s, span_max, pi, S, sp, stride);
            else
                decode_span(q + i * H * D, k_cache, v_cache, 0, table, block_size, H, KVH, D,
                            t0, t1, scale, s, span_max, pi, S, sp, stride);
        }
        free(s);
        if (!failed) { /* every thread sees the same value: set before the barrier above */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < n * H; task++) {
                int64_t i = task / H, h = task % H, S = first[i + 1] - first[i];
                const float *pp = part + (first[i] * H + h * S) * stride;
                float m = -INFINITY, total = 0.f, *o = out + task * D;
                for (int64_t sp = 0; sp < S; sp++)
                    m = pp[sp * stride + D] > m ? pp[sp * stride + D] : m;
                memset(o, 0, (size_t)D * sizeof(float));
                for (int64_t sp = 0; sp < S; sp++) {
                    const float *p = pp + sp * stride;
                    if (p[D + 1] == 0.f) continue; /* an empty span */
                    float w = expf(p[D] - m);
                    total += w * p[D + 1];
                    axpy_f32(o, w, p, D);
                }
                float inv = 1.f / total;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
    }
    free(part), free(row_of), free(first);
    return failed ? -1 : 0;
}

/* rotate-half on the first r dims of x [d]: x * cos + [x2, x1] * ssin (ssin signed) */
static void rotate_row(float *x, const float *cos, const float *ssin, int64_t r) {
    float tmp[512];
    int64_t half = r / 2;
    memcpy(tmp, x, (size_t)r * sizeof(float));
    for (int64_t j = 0; j < r; j++) {
        float swapped = j < half ? tmp[j + half] : tmp[j - half];
        x[j] = tmp[j] * cos[j] + swapped * ssin[j];
    }
}

/* In place on qkv [M, (H + 2 KVH) D] float32: RMSNorm each q and k head (Qwen3's q_norm /
 * k_norm, when given) and rotate its first r dims (cos, ssin [M, r]; r = 0: no rotary). Rows
 * split over threads once there are enough of them: a prompt's q and k through torch's
 * rotary took ~0.8 ms a layer at 1024 tokens. */
int hx_qk_prepare(float *qkv, int64_t M, int64_t H, int64_t KVH, int64_t D,
                  const float *q_norm, const float *k_norm, float eps, const float *cos,
                  const float *ssin, int64_t r, int num_threads) {
    if (M < 0 || KVH < 1 || H < 1 || D < 1 || r < 0 || r > D || r % 2 || r > 512) return -1;
    int64_t width = (H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * width >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        float *q = qkv + m * width, *k = q + H * D;
        for (int64_t h = 0; h < H; h++) {
            if (q_norm) norm_row(q + h * D, q_norm, q + h * D, D, eps);
            if (r) rotate_row(q + h * D, cos + m * r, ssin + m * r, r);
        }
        for (int64_t h = 0; h < KVH; h++) {
            if (k_norm) norm_row(k + h * D, k_norm, k + h * D, D, eps);
            if (r) rotate_row(k + h * D, cos + m * r, ssin + m * r, r);
        }
    }
    return 0;
}

/* A decode step's attention block after the qkv projection, float32, in one call: split qkv
 * [M, (H + 2 KVH) D] into q, k, v; norms and rotary as hx_qk_prepare; write k and v to
 * their cache slots (as halves where kv_f16); attend over each row's lens[m] tokens (tables
 * [M, max_blocks]) → out [M, H D]. qkv is used as scratch. */
int hx_decode_attention(float *qkv, int64_t M, int64_t H, int64_t KVH, int64_t D,
                        const float *q_norm, const float *k_norm, float eps, const float *cos,
                        const float *ssin, int64_t r, const int64_t *slots, void *k_cache,
                        void *v_cache, int kv_f16, int64_t block_size, const int64_t *tables,
                        int64_t max_blocks, const int32_t *lens, float scale, float *out,
                        int num_threads) {
    if (M < 1 || KVH < 1 || H % KVH ||
        hx_qk_prepare(qkv, M, H, KVH, D, q_norm, k_norm, eps, cos, ssin, r, num_threads))
        return -1;
    int64_t width = (H + 2 * KVH) * D;
    for (int64_t m = 0; m < M; m++) {
        const float *k = qkv + m * width + H * D, *v = k + KVH * D;
        kv_put(k_cache, slots[m] * KVH * D, k, KVH * D, kv_f16);
        kv_put(v_cache, slots[m] * KVH * D, v, KVH * D, kv_f16);
    }
    /* q rows of the batch sit `width` apart: copy them together for hx_paged_decode */
    float *qs = malloc((size_t)(M * H * D) * sizeof(float));
    if (!qs) return -1;
    for (int64_t m = 0; m < M; m++) memcpy(qs + m * H * D, qkv + m * width, (size_t)(H * D) * sizeof(float));
    int rc = hx_paged_decode(qs, M, H, KVH, D, k_cache, v_cache, kv_f16, block_size, tables,
                             max_blocks, lens, scale, out, num_threads);
    free(qs);
    return rc;
}

/* out [M, I] = silu(x[:, :I]) * x[:, I:], x [M, 2I]. Eight lanes at a time through exp256,
 * -g capped at 88 so that 2^n stays a float, and g below -88 giving 0 as expf does. Rows split
 * over threads once a call is big enough to pay for them (a prompt chunk's 512 x 1536 took
 * 3.1 ms through scalar expf on one thread), unless out is x itself: in place, row m's
 * outputs land on rows before m, which only an in-order loop has read by then. */
int hx_silu_mul(const float *x, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M * I >= (1 << 16) && out != x)
    for (int64_t m = 0; m < M; m++) {
        const float *g = x + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(88.f);
        const __m256 zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(zero, gv), cap));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            s = _mm256_andnot_ps(_mm256_cmp_ps(gv, _mm256_sub_ps(zero, cap), _CMP_LT_OQ), s);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* Per row of x [M, N]: idx = the first index of its largest value (of its first NaN if it
 * has one, as torch.argmax), finite = whether every value is finite. One pass for the max
 * and finiteness (x - x is 0 exactly where x is finite), one for the index; a step's logits
 * over SmolLM2's 49152 tokens took 134 us in torch.argmax and 136 in isfinite().all(). */
int hx_argmax_finite(const float *x, int64_t M, int64_t N, int64_t *idx, uint8_t *finite) {
    if (M < 1 || N < 1) return -1;
#pragma omp parallel for schedule(static) if (M * N >= (1 << 20))
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * N;
        float best = r[0], bad = 0.f;
        int64_t j = 0;
#ifdef __AVX2__
        if (N >= 8) {
            __m256 vmax = _mm256_loadu_ps(r), vbad = _mm256_setzero_ps();
            for (; j + 8 <= N; j += 8) {
                __m256 v = _mm256_loadu_ps(r + j);
                vmax = _mm256_max_ps(vmax, v);
                vbad = _mm256_or_ps(vbad, _mm256_sub_ps(v, v)); /* NaN where v is not finite */
            }
            float lanes[8], flags[8];
            _mm256_storeu_ps(lanes, vmax);
            _mm256_storeu_ps(flags, vbad);
            for (int l = 0; l < 8; l++) {
                best = lanes[l] > best ? lanes[l] : best;
                bad = flags[l] != 0.f ? 1.f : bad; /* NaN != 0 too */
            }
        }
#endif
        for (; j < N; j++) {
            best = r[j] > best ? r[j] : best;
            if (r[j] - r[j] != 0.f) bad = 1.f;
        }
        int64_t at = -1;
        if (bad != 0.f) /* torch.argmax takes a NaN for the max: the first one */
            for (int64_t k = 0; k < N && at < 0; k++)
                if (r[k] != r[k]) at = k;
        for (int64_t k = 0; k < N && at < 0; k++)
            if (r[k] == best) at = k;
        idx[m] = at < 0 ? 0 : at;
        finite[m] = bad == 0.f;
    }
    return 0;
}

/* y [M, N] = x [M, K] @ W^T with x in float32 as it is (no int8 quantization): each block's
 * weights are widened to the exact floats `dequantize` gives (w = d q + m) and multiplied
 * in float32. For prompt steps' few-row calls (a chunk's last rows, the logits of the
 * prompt's last token), where int8 activations' ~0.5% would move near-tied logits. */
int hx_blocks_matmul_f32(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x,
                         int64_t M, float *y, int num_threads) {
    if (hx_kq_is_kind(kind)) return hx_kq_matmul_f32(kind, w, N, K, x, M, y, num_threads);
    if (K % QK || M < 1 || N < 1 || kind < 0 || kind > KIND_LAST || (is_x8(kind) && N % XR))
        return -1;
    int64_t nb = K / QK, bb = hx_block_bytes(kind), row_bytes = nb * bb;
#ifdef __AVX2__
    if (is_x8(kind)) { /* each group widened once for up to MT rows of x */
        x8_tiles(base_kind(kind), w, N, nb, K, M, x, NULL, NULL, NULL, y, num_threads);
        return 0;
    }
#endif
    if (is_x8(kind)) { /* each group's 8 rows unpacked, then row by row as below */
        int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < N / XR; g++) {
            float *rows = malloc((size_t)(XR * K) * sizeof(float));
            if (!rows) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            group_unpack(base_kind(kind), w + g * XR * row_bytes, nb, rows, K);
            for (int r = 0; r < XR; r++)
                for (int64_t m = 0; m < M; m++)
                    y[m * N + g * XR + r] = dot_f32(rows + r * K, x + m * K, K);
            free(rows);
        }
        return failed ? -1 : 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float sum = 0.f;
#ifdef __AVX2__
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bb, *qs = block_qs(kind, blk);
                float d = block_d(blk);
                __m256 dv = _mm256_set1_ps(d), wv[4];
                if (kind == KIND_Q8_0) {
                    for (int j = 0; j < 4; j++) {
                        __m128i q8 = _mm_loadl_epi64((const __m128i *)(qs + 8 * j));
                        wv[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), dv);
                    }
                } else {
                    __m256 mv = _mm256_set1_ps(block_m(kind, blk, d));
                    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
                    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
                    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    for (int j = 0; j < 4; j++) {
                        __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
                        wv[j] = _mm256_fmadd_ps(qf, dv, mv);
                    }
                }
                for (int j = 0; j < 4; j++)
                    acc = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xm + b * QK + 8 * j), acc);
            }
            sum = hsum8(acc);
#else
            for (int64_t b = 0; b < nb; b++) {
                float wb[QK];
                dequant_block(kind, row + b * bb, wb);
                for (int j = 0; j < QK; j++) sum += wb[j] * xm[b * QK + j];
            }
#endif
            y[m * N + n] = sum;
        }
    }
    return 0;
}

/* out [K, N] float32 = the weight the blocks hold, transposed (hx_dequantize's out^T): what a
 * prompt chunk's GEMM takes as x @ out, which ran 1.5-4% faster than x @ W^T for SmolLM2's
 * shapes at 1024-128 rows. Threads split the blocks along K, so that each writes whole
 * rows of out. */
int hx_dequantize_t(int kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                    int num_threads) {
    if (hx_kq_is_kind(kind)) return hx_kq_dequantize_t(kind, w, N, K, out, num_threads);
    if (K % QK || N < 1 || kind < 0 || kind > KIND_LAST || (is_x8(kind) && N % XR)) return -1;
    int64_t nb = K / QK, bb = hx_block_bytes(kind), row_bytes = nb * bb;
    const int base = base_kind(kind);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < nb; b++) {
        float *o = out + b * QK * N;
        if (is_x8(kind)) {
            for (int64_t g = 0; g < N / XR; g++)
                group_block_t(base, w + g * XR * row_bytes + b * XR * bb, o + g * XR, N);
            continue;
        }
        float v[QK];
        for (int64_t n = 0; n < N; n++) {
            dequant_block(kind, w + n * row_bytes + b * bb, v);
            for (int j = 0; j < QK; j++) o[j * N + n] = v[j];
        }
    }
    return 0;
}

/* out [N, K] float32 = the weight the blocks hold (GGUF's arithmetic, as `dequantize` in
 * native.py computes it): what a prompt chunk's float32 GEMM takes, unpacked for the call. */
int hx_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, float *out, int num_threads) {
    if (hx_kq_is_kind(kind)) return hx_kq_dequantize(kind, w, N, K, out, num_threads);
    if (K % QK || N < 1 || kind < 0 || kind > KIND_LAST || (is_x8(kind) && N % XR)) return -1;
    int64_t nb = K / QK, bb = hx_block_bytes(kind), row_bytes = nb * bb;
    if (is_x8(kind)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < N / XR; g++)
            group_unpack(base_kind(kind), w + g * XR * row_bytes, nb, out + g * XR * K, K);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++)
            dequant_block(kind, w + n * row_bytes + b * bb, out + n * K + b * QK);
    }
    return 0;
}

/* out [n, K] float32 = rows ids[0..n) of the weight (a tied embedding's lookup) */
int hx_rows(int kind, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n,
            float *out) {
    if (hx_kq_is_kind(kind)) return hx_kq_rows(kind, w, N, K, ids, n, out);
    if (K % QK || N < 1 || kind < 0 || kind > KIND_LAST || (is_x8(kind) && N % XR)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    int64_t nb = K / QK, bb = hx_block_bytes(kind), row_bytes = nb * bb;
    const int base = base_kind(kind);
    uint8_t blk[34];
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = w + id * row_bytes + b * bb;
            if (is_x8(kind)) {
                group_row(base, w + (id / XR) * XR * row_bytes + b * XR * bb, (int)(id % XR), blk);
                src = blk;
            }
            dequant_block(base, src, out + i * K + b * QK);
        }
    }
    return 0;
}

/* -- a whole decoder layer of a decode step -------------------------------------------- */

typedef struct hx_linear {
    int kind;             /* KIND_* of the blocks */
    const uint8_t *w;     /* [n, k / block weights * block bytes] */
    int64_t n, k;         /* out_features, in_features */
    const float *bias;    /* [n] or NULL; of a chain of parts: the whole width's, on the first */
    /* the next part of a Linear fused from parts held as different kinds (a Q4_K_M file's
     * Q4_K q/k beside its Q6_K v): its outputs follow this part's */
    const struct hx_linear *next;
} hx_linear;

/* out_features of a Linear: its parts' together */
static int64_t lin_n(const hx_linear *l) {
    int64_t n = 0;
    for (; l; l = l->next) n += l->n;
    return n;
}

static int linear_run(const hx_linear *l, const float *x, int64_t M, float *y, int nt) {
    int64_t width = lin_n(l);
    int rc = 0;
    if (!l->next) {
        rc = hx_blocks_matmul(l->kind, l->w, l->n, l->k, x, M, y, nt);
    } else { /* each part into its own buffer, then into its columns of y */
        int64_t most = 0, off = 0;
        for (const hx_linear *p = l; p; p = p->next) most = p->n > most ? p->n : most;
        float *part = malloc((size_t)(M * most) * sizeof(float));
        if (!part) return -1;
        for (const hx_linear *p = l; p && rc == 0; off += p->n, p = p->next) {
            rc = p->k == l->k ? hx_blocks_matmul(p->kind, p->w, p->n, p->k, x, M, part, nt) : -1;
            for (int64_t m = 0; rc == 0 && m < M; m++)
                memcpy(y + m * width + off, part + m * p->n, (size_t)p->n * sizeof(float));
        }
        free(part);
    }
    if (rc == 0 && l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < width; i++) y[m * width + i] += l->bias[i];
    return rc;
}

/* One Llama/Qwen2/Qwen3 decoder layer for M decode rows, float32, as DecoderLayer.forward
 * computes it through the calls above: residual += x (residual_in NULL: the first layer,
 * residual = x); h = RMSNorm(residual); attention (qkv, hx_decode_attention, o); residual
 * += that; h = RMSNorm(residual); SwiGLU MLP (gate_up, SiLU-and-mul, down) → out [M,
 * hidden]. x, residual_in and residual_out may alias. One call instead of eight, each with
 * its Python around it. */
int hx_decode_layer(const float *x, const float *residual_in, float *residual_out, int64_t M,
                    int64_t hidden, const float *norm1, const float *norm2, float eps,
                    const hx_linear *qkv, const hx_linear *o, const hx_linear *gate_up,
                    const hx_linear *down, int64_t H, int64_t KVH, int64_t D,
                    const float *q_norm, const float *k_norm, float qk_eps, const float *cos,
                    const float *ssin, int64_t r, const int64_t *slots, void *k_cache,
                    void *v_cache, int kv_f16, int64_t block_size, const int64_t *tables,
                    int64_t max_blocks, const int32_t *lens, float scale, float *out,
                    int num_threads) {
    int64_t inter = lin_n(gate_up) / 2, width = lin_n(qkv);
    if (qkv->k != hidden || lin_n(o) != hidden || o->k != H * D || gate_up->k != hidden ||
        down->k != inter || lin_n(down) != hidden || width != (H + 2 * KVH) * D)
        return -1;
    size_t f = sizeof(float);
    float *h = malloc((size_t)(M * hidden) * f), *buf = malloc((size_t)(M * width) * f);
    float *attn = malloc((size_t)(M * H * D) * f), *gu = malloc((size_t)(M * 2 * inter) * f);
    int rc = -1;
    if (!h || !buf || !attn || !gu) goto done;
    rc = hx_rms_norm(x, residual_in, norm1, h, residual_out, M, hidden, eps, num_threads);
    if (rc == 0 && !residual_in && residual_out != x)
        memcpy(residual_out, x, (size_t)(M * hidden) * f);
    if (rc == 0) rc = linear_run(qkv, h, M, buf, num_threads);
    if (rc == 0)
        rc = hx_decode_attention(buf, M, H, KVH, D, q_norm, k_norm, qk_eps, cos, ssin, r, slots,
                                 k_cache, v_cache, kv_f16, block_size, tables, max_blocks, lens,
                                 scale, attn, num_threads);
    if (rc == 0) rc = linear_run(o, attn, M, out, num_threads);
    if (rc == 0)
        rc = hx_rms_norm(out, residual_out, norm2, h, residual_out, M, hidden, eps, num_threads);
    if (rc == 0) rc = linear_run(gate_up, h, M, gu, num_threads);
    /* in place: row m's [inter] result lands before row m's input, which it has read */
    if (rc == 0) rc = hx_silu_mul(gu, M, inter, gu);
    if (rc == 0) rc = linear_run(down, gu, M, out, num_threads);
done:
    free(h); free(buf); free(attn); free(gu);
    return rc;
}

/* -- every decoder layer of a decode step --------------------------------------------------- */

typedef struct {
    const float *norm1, *norm2; /* input and post-attention RMSNorm weights */
    float eps;
    const hx_linear *qkv, *o, *gate_up, *down;
    int64_t H, KVH, D;
    const float *q_norm, *k_norm; /* [D] or NULL */
    float qk_eps;
    void *k_cache, *v_cache; /* [blocks, block_size, KVH, D], float32 or (kv_f16) half */
    int64_t block_size;
    float scale;
    int kv_f16;
} hx_layer;

/* hx_decode_layer over `n_layers` layers in turn, from the embeddings x [M, hidden] (the first
 * layer's input, residual none) to the last layer's (out, residual) [M, hidden]: one call a
 * step instead of one a layer, each with its Python and its 31 ctypes arguments (~20 µs a
 * layer at batch 1). */
int hx_decode_layers(const hx_layer *layers, int64_t n_layers, const float *x, float *out,
                     float *residual, int64_t M, int64_t hidden, const float *cos,
                     const float *ssin, int64_t r, const int64_t *slots, const int64_t *tables,
                     int64_t max_blocks, const int32_t *lens, int num_threads) {
    if (n_layers < 1) return -1;
    float *spare = malloc((size_t)(M * hidden) * sizeof(float));
    if (!spare) return -1;
    /* layer l writes into out or spare, so that the last one writes into out */
    float *bufs[2] = {n_layers % 2 ? out : spare, n_layers % 2 ? spare : out};
    const float *cur = x;
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const hx_layer *y = layers + l;
        float *dst = bufs[l % 2];
        rc = hx_decode_layer(cur, l ? residual : NULL, residual, M, hidden, y->norm1, y->norm2,
                             y->eps, y->qkv, y->o, y->gate_up, y->down, y->H, y->KVH, y->D,
                             y->q_norm, y->k_norm, y->qk_eps, cos, ssin, r, slots, y->k_cache,
                             y->v_cache, y->kv_f16, y->block_size, tables, max_blocks, lens,
                             y->scale, dst, num_threads);
        cur = dst;
    }
    free(spare);
    return rc;
}
