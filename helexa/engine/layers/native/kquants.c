/* GGUF K-quant matmuls for the CPU: y[M, N] = x[M, K] @ W[N, K]^T with W held as the file
 * holds it, rows of 256-weight super-blocks of Q4_K, Q5_K or Q6_K, never widened.
 *
 *   Q4_K [d f16][dmin f16][12 B: 8 six-bit scales, 8 six-bit mins][128 B nibbles]
 *        w = d * sc[j] * q - dmin * m[j], sub-block j of 32; q 0..15
 *   Q5_K [d][dmin][12 B scales/mins][32 B high bits][128 B nibbles]     q 0..31
 *   Q6_K [128 B low nibbles][64 B 2-bit highs][16 x int8 scales][d f16]
 *        w = d * sc[j] * (q - 32), sub-block j of 16; q 0..63
 *
 * The nibbles of Q4_K/Q5_K come in 4 runs of 32 bytes: run c's low nibbles are sub-block 2c,
 * its high nibbles sub-block 2c + 1 (Q5_K's bit j of high byte i is weight i's fifth bit in
 * sub-block j). Q6_K's weight 128 r + 32 k + i (r < 2, k < 4, i < 32) has its low four bits
 * in byte 64 r + 32 (k % 2) + i of the low nibbles (high nibble when k >= 2) and its top two
 * in bits 2k, 2k + 1 of byte 32 r + i of the highs. (helexa/engine/loader/dequant.py is the
 * same arithmetic in torch; every weight w is exact in float32: at most 24 significant bits
 * before the one subtraction.)
 *
 * The activations are quantized per 256 to int8 (a float scale each, and the sums of every 16
 * codes, for the mins and Q6_K's -32): llama.cpp's Q8_K. A super-block's dot is then integer
 * multiply-adds (AVX2 maddubs: u8 weights times s8 activations, and madd by the sub-block
 * scale) and two floats. Rows of W split over threads in chunks; each chunk is read once for
 * up to MT rows of x. The scalar loops under #else are the reference and the path for CPUs
 * without AVX2. Built with blocks.c (native.py), which hands the K kinds to the hx_kq_*
 * functions here.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "common.h"

enum { QK_K = 256, KQ_MT = 4, KQ_CHUNK = 16, KQ_XR = 8 };
/* the kinds' numbers, as native.KINDS has them; "x8": 8 rows interleaved (see below) */
enum { KIND_Q4_K = 6, KIND_Q5_K = 7, KIND_Q6_K = 8 };
enum { KIND_Q4_KX8 = 9, KIND_Q6_KX8 = 10, KIND_Q5_KX8 = 11 };
/* bytes of an x8 group's super-block */
enum { GB_Q4_K = 1184, GB_Q5_K = 1440, GB_Q6_K = 1680 };
/* how far ahead the x8 kernels ask for their weights (as blocks.c's PREFETCH) */
enum { KQ_PREFETCH = 4096 };

int hx_kq_is_kind(int kind) { return kind >= KIND_Q4_K && kind <= KIND_Q5_KX8; }
static inline int kq_is_x8(int kind) { return kind >= KIND_Q4_KX8; }
static inline int kq_base(int kind) {
    return kind == KIND_Q4_KX8   ? KIND_Q4_K
           : kind == KIND_Q5_KX8 ? KIND_Q5_K
           : kind == KIND_Q6_KX8 ? KIND_Q6_K
                                 : kind;
}
static inline int64_t kq_group_bytes(int base) {
    return base == KIND_Q4_K ? GB_Q4_K : base == KIND_Q5_K ? GB_Q5_K : GB_Q6_K;
}

/* bytes of one row's super-block (x8: its share of its group's) */
int hx_kq_block_bytes(int kind) {
    switch (kind) {
    case KIND_Q4_K: return 144;
    case KIND_Q5_K: return 176;
    case KIND_Q4_KX8: return GB_Q4_K / 8;
    case KIND_Q5_KX8: return GB_Q5_K / 8;
    default: return 210;
    }
}

static inline float kq_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Q4_K/Q5_K's 12 bytes -> 8 scales and 8 mins of 6 bits: bytes 0-3 hold scales 0-3 (low 6
 * bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the
 * low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble). */
static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* the super-block's 256 weights as floats (dequant.py's arithmetic, exact) */
static void kq_dequant(int kind, const uint8_t *blk, float *o) {
    if (kind == KIND_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = kq_f16(blk + 208);
        for (int r = 0; r < 2; r++)
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 32; i++) {
                    int w = 128 * r + 32 * k + i;
                    int lo = (ql[64 * r + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15;
                    int hi = (qh[32 * r + i] >> (2 * k)) & 3;
                    o[w] = (float)((lo | (hi << 4)) - 32) * (d * (float)sc[w / 16]);
                }
        return;
    }
    const float d = kq_f16(blk), dmin = kq_f16(blk + 2);
    uint8_t sc[8], mn[8];
    k_scales(blk + 4, sc, mn);
    const uint8_t *qh = blk + 16, *qs = blk + (kind == KIND_Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++) {
            int j = 2 * c + h;
            float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
            for (int i = 0; i < 32; i++) {
                int q = (qs[32 * c + i] >> (4 * h)) & 15;
                if (kind == KIND_Q5_K) q |= ((qh[i] >> j) & 1) << 4;
                o[32 * j + i] = (float)q * ds - dm;
            }
        }
}

/* -- x8: 8 rows' super-blocks side by side --------------------------------------------------
 * As blocks.c's x8 kinds: rows in 8s (nearly all weights) are held as groups of 8 rows, whose
 * super-blocks lie together, laid out so that a 32-byte load holds 4 consecutive codes of each
 * of the 8 rows (one row a 32-bit lane): against 4 activations broadcast to every lane,
 * maddubs leaves each row's partial dot in its own lane, and a super-block's 8 dots come out
 * as one vector, with no horizontal sums. The file's bytes, reordered (the 6-bit scales of
 * Q4_K unpacked to bytes: 148 bytes a row's super-block for 144):
 *
 *   Q4_Kx8 [d f16 x 8][dmin f16 x 8]
 *          then per pair c of sub-blocks (2c, 2c + 1): [scales: byte 2r + h = row r's scale
 *          of sub-block 2c + h][mins: the same]
 *          then codes: byte 32 (8c + t) + 4r + k = byte 32c + 4t + k of row r's nibbles
 *   Q5_Kx8 as Q4_Kx8, with between the pairs and the codes the fifth bits: per pair c and
 *          tq < 2, 32 bytes: bit 2 (t % 4) + h of byte 4r + k = the fifth bit of row r's
 *          weight 4t + k of sub-block 2c + h, t = 4 tq + t % 4 (codes at 416 for 160)
 *   Q6_Kx8 [d f16 x 8][scales: byte 16u + 2r + h = row r's scale of sub-block 2u + h]
 *          then per t < 16, three runs of 32 bytes, byte 4r + k of row r's codes q[p] at
 *          the positions p = 4t + k + 64 j (j < 4): [lo(q j=0) | lo(q j=1) << 4]
 *          [lo(q j=2) | lo(q j=3) << 4][hi(q j=0) | hi(j=1) << 2 | hi(j=2) << 4 | hi(j=3) << 6]
 *          (lo: the low 4 bits, hi: the top 2)
 */

/* Q4_K/Q5_K's 12 bytes back from 8 scales and 8 mins (k_scales undone) */
static inline void k_scales_pack(const uint8_t *sc, const uint8_t *mn, uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
}

/* a Q6_K super-block's 256 codes q (0..63) in order, and back */
static inline void q6_codes(const uint8_t *blk, uint8_t *q) {
    for (int p = 0; p < QK_K; p++) {
        int r = p / 128, k = (p % 128) / 32, i = p % 32;
        int lo = (blk[64 * r + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15;
        q[p] = (uint8_t)(lo | (((blk[128 + 32 * r + i] >> (2 * k)) & 3) << 4));
    }
}
static inline void q6_codes_pack(const uint8_t *q, uint8_t *blk) {
    memset(blk, 0, 192);
    for (int p = 0; p < QK_K; p++) {
        int r = p / 128, k = (p % 128) / 32, i = p % 32;
        blk[64 * r + 32 * (k % 2) + i] |= (uint8_t)((q[p] & 15) << (4 * (k / 2)));
        blk[128 + 32 * r + i] |= (uint8_t)((q[p] >> 4) << (2 * k));
    }
}

/* row r's super-block as the file holds it, from its group's */
static void group_row_k(int base, const uint8_t *g, int r, uint8_t *blk) {
    if (base != KIND_Q6_K) {
        const int q5 = base == KIND_Q5_K, at = q5 ? 416 : 160, qs = q5 ? 48 : 16;
        uint8_t sc[8], mn[8];
        memcpy(blk, g + 2 * r, 2);
        memcpy(blk + 2, g + 16 + 2 * r, 2);
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                sc[2 * c + h] = g[32 + 32 * c + 2 * r + h];
                mn[2 * c + h] = g[32 + 32 * c + 16 + 2 * r + h];
            }
        k_scales_pack(sc, mn, blk + 4);
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 8; t++) memcpy(blk + qs + 32 * c + 4 * t, g + at + 32 * (8 * c + t) + 4 * r, 4);
        if (q5) { /* bit j of qh[i]: weight i of sub-block j */
            memset(blk + 16, 0, 32);
            for (int c = 0; c < 4; c++)
                for (int t = 0; t < 8; t++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t bits = g[160 + 64 * c + 32 * (t / 4) + 4 * r + k] >> (2 * (t % 4));
                        blk[16 + 4 * t + k] |= (uint8_t)(((bits & 1) << (2 * c)) | (((bits >> 1) & 1) << (2 * c + 1)));
                    }
        }
        return;
    }
    uint8_t q[QK_K];
    const uint8_t *codes = g + 144;
    for (int t = 0; t < 16; t++)
        for (int k = 0; k < 4; k++) {
            int at = 96 * t + 4 * r + k;
            uint8_t l0 = codes[at], l1 = codes[at + 32], h = codes[at + 64];
            q[4 * t + k] = (uint8_t)((l0 & 15) | ((h & 3) << 4));
            q[64 + 4 * t + k] = (uint8_t)((l0 >> 4) | (((h >> 2) & 3) << 4));
            q[128 + 4 * t + k] = (uint8_t)((l1 & 15) | (((h >> 4) & 3) << 4));
            q[192 + 4 * t + k] = (uint8_t)((l1 >> 4) | ((h >> 6) << 4));
        }
    q6_codes_pack(q, blk);
    for (int u = 0; u < 8; u++)
        for (int h = 0; h < 2; h++) blk[192 + 2 * u + h] = g[16 + 16 * u + 2 * r + h];
    memcpy(blk + 208, g + 2 * r, 2);
}

/* row r's super-block into its group's place (group_row_k undone) */
static void row_into_group(int base, const uint8_t *blk, int r, uint8_t *g) {
    if (base != KIND_Q6_K) {
        const int q5 = base == KIND_Q5_K, at = q5 ? 416 : 160, qs = q5 ? 48 : 16;
        uint8_t sc[8], mn[8];
        memcpy(g + 2 * r, blk, 2);
        memcpy(g + 16 + 2 * r, blk + 2, 2);
        k_scales(blk + 4, sc, mn);
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                g[32 + 32 * c + 2 * r + h] = sc[2 * c + h];
                g[32 + 32 * c + 16 + 2 * r + h] = mn[2 * c + h];
            }
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 8; t++) memcpy(g + at + 32 * (8 * c + t) + 4 * r, blk + qs + 32 * c + 4 * t, 4);
        if (q5)
            for (int c = 0; c < 4; c++)
                for (int t = 0; t < 8; t++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t *to = g + 160 + 64 * c + 32 * (t / 4) + 4 * r + k, qh = blk[16 + 4 * t + k];
                        if (t % 4 == 0) *to = 0;
                        *to |= (uint8_t)((((qh >> (2 * c)) & 1) | (((qh >> (2 * c + 1)) & 1) << 1)) << (2 * (t % 4)));
                    }
        return;
    }
    uint8_t q[QK_K];
    q6_codes(blk, q);
    uint8_t *codes = g + 144;
    for (int t = 0; t < 16; t++)
        for (int k = 0; k < 4; k++) {
            int at = 96 * t + 4 * r + k;
            uint8_t a = q[4 * t + k], b = q[64 + 4 * t + k], c = q[128 + 4 * t + k],
                    e = q[192 + 4 * t + k];
            codes[at] = (uint8_t)((a & 15) | ((b & 15) << 4));
            codes[at + 32] = (uint8_t)((c & 15) | ((e & 15) << 4));
            codes[at + 64] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
    for (int u = 0; u < 8; u++)
        for (int h = 0; h < 2; h++) g[16 + 16 * u + 2 * r + h] = blk[192 + 2 * u + h];
    memcpy(g + 2 * r, blk + 208, 2);
}

/* a weight of file rows [N, K / 256 super-blocks of `kind`] (N a multiple of 8) as its x8
 * form, and back: the same bytes (Q4_K's scales unpacked), threads splitting the groups */
int hx_kq_interleave(int kind, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst,
                     int reverse, int num_threads) {
    if (!hx_kq_is_kind(kind) || kq_is_x8(kind) || N % KQ_XR || K % QK_K || K < QK_K) return -1;
    int64_t nsb = K / QK_K, bb = hx_kq_block_bytes(kind);
    int64_t gb = kq_group_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < N / KQ_XR; g++)
        for (int64_t b = 0; b < nsb; b++)
            for (int r = 0; r < KQ_XR; r++) {
                if (reverse)
                    group_row_k(kind, src + (g * nsb + b) * gb, r,
                                dst + (g * KQ_XR + r) * nsb * bb + b * bb);
                else
                    row_into_group(kind, src + (g * KQ_XR + r) * nsb * bb + b * bb, r,
                                   dst + (g * nsb + b) * gb);
            }
    return 0;
}

/* row n's super-block b of a weight of `kind` (x8 or not) as the file holds it: `tmp` filled
 * for an x8 kind, else a pointer into w */
static inline const uint8_t *file_block(int kind, const uint8_t *w, int64_t nsb, int64_t n,
                                        int64_t b, uint8_t *tmp) {
    if (!kq_is_x8(kind)) return w + (n * nsb + b) * hx_kq_block_bytes(kind);
    const int base = kq_base(kind);
    const int64_t gb = kq_group_bytes(base);
    group_row_k(base, w + ((n / KQ_XR) * nsb + b) * gb, (int)(n % KQ_XR), tmp);
    return tmp;
}

/* A quarter (positions [64 j, 64 j + 64)) of a group's super-block as floats, position by
 * position: buf[ld (p - 64 j) + r] = row r's weight p (ld 8: packed; N: straight into a
 * transposed weight's rows) (dequant.py's arithmetic: d sc exact
 * in float32, q d sc exact, one rounding at most after). With AVX2 straight from the group's
 * codes, 8 rows a vector; else row by row. A quarter is Q4_K's sub-blocks 2j and 2j + 1, and
 * Q6_K's codes j of each run. */
static void kq_x8_quarter(int base, const uint8_t *g, int j, float *buf, int64_t ld) {
#ifdef __AVX2__
    const __m256i low = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3);
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    if (base != KIND_Q6_K) {
        const int q5 = base == KIND_Q5_K;
        const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        const uint8_t *codes = g + (q5 ? 416 : 160), *fifth = g + 160 + 64 * j;
        /* bytes 2r + h of the pairs: row r's scale (min) of sub-block 2j + h */
        __m256i pairs = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 32 + 32 * j)));
        __m256i mpairs = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 48 + 32 * j)));
        const __m256i half = _mm256_set1_epi32(0xffff);
        for (int h = 0; h < 2; h++) {
            __m256i sc = h ? _mm256_srli_epi32(pairs, 16) : _mm256_and_si256(pairs, half);
            __m256i mn = h ? _mm256_srli_epi32(mpairs, 16) : _mm256_and_si256(mpairs, half);
            __m256 ds = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(sc));
            __m256 dm = _mm256_mul_ps(dm8, _mm256_cvtepi32_ps(mn));
            for (int t = 0; t < 8; t++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + 32 * (8 * j + t)));
                __m256i hb = q5 ? _mm256_loadu_si256((const __m256i *)(fifth + 32 * (t / 4)))
                                : _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    __m256i q = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * k + 4 * h), low);
                    if (q5) {
                        __m256i bit = _mm256_srli_epi32(hb, 8 * k + 2 * (t % 4) + h);
                        q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(bit, _mm256_set1_epi32(1)), 4));
                    }
                    __m256 v = _mm256_fmsub_ps(_mm256_cvtepi32_ps(q), ds, dm);
                    _mm256_storeu_ps(buf + ld * (32 * h + 4 * t + k), v);
                }
            }
        }
        return;
    }
    const uint8_t *codes = g + 144;
    __m256 dsc[4];
    for (int u = 0; u < 2; u++) { /* lanes r: (scale 2v, scale 2v + 1) of row r, int16 */
        __m256i pairs = _mm256_cvtepi8_epi16(
            _mm_loadu_si128((const __m128i *)(g + 16 + 16 * (2 * j + u))));
        __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16);
        dsc[2 * u] = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(even));
        dsc[2 * u + 1] = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_srai_epi32(pairs, 16)));
    }
    for (int t = 0; t < 16; t++) {
        __m256i l = _mm256_loadu_si256((const __m256i *)(codes + 96 * t + 32 * (j / 2)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(codes + 96 * t + 64));
        for (int k = 0; k < 4; k++) {
            __m256i lo = _mm256_and_si256(_mm256_srli_epi32(l, 8 * k + 4 * (j % 2)), low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi32(hb, 8 * k + 2 * j), three);
            __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                         _mm256_set1_epi32(32));
            int p = 4 * t + k; /* within the quarter: sub-block 4 j + p / 16 */
            _mm256_storeu_ps(buf + ld * p, _mm256_mul_ps(_mm256_cvtepi32_ps(q), dsc[p / 16]));
        }
    }
#else
    uint8_t blk[256];
    float row[QK_K];
    for (int r = 0; r < KQ_XR; r++) {
        group_row_k(base, g, r, blk);
        kq_dequant(base, blk, row);
        for (int p = 0; p < 64; p++) buf[ld * p + r] = row[64 * j + p];
    }
#endif
}

/* the whole super-block: buf[8 p + r], p < 256 */
static void kq_x8_unpack(int base, const uint8_t *g, float *buf) {
    for (int j = 0; j < 4; j++) kq_x8_quarter(base, g, j, buf + 8 * 64 * j, 8);
}

/* x [M, K] -> q [M, K] int8, d [M, K/256] and bs [M, K/16] (the sums of each 16 codes),
 * rounding to nearest even as lrintf does */
static void kq_quantize_x(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int16_t *bs) {
    int64_t nsb = K / QK_K;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t i = 0; i < M * nsb; i++) {
        const float *v = x + i * QK_K;
        float amax = 0.f;
        for (int j = 0; j < QK_K; j++) amax = fmaxf(amax, fabsf(v[j]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[i] = amax / 127.f;
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) {
                int qj = (int)lrintf(v[j] * inv);
                q[i * QK_K + j] = (int8_t)qj;
                sum += qj;
            }
            bs[i * (QK_K / 16) + g] = (int16_t)sum;
        }
    }
}

#ifdef __AVX2__
/* sum over 32 u8 weights times s8 activations, times a scale per 16 (lanes 0-7: the first
 * 16 weights' pairs, 8-15: the second's), as 8 int32 */
static inline __m256i kq_dot32(__m256i w, __m256i x, __m256i scale) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale);
}
#endif

/* Rows [n0, n1) of W against mt (<= KQ_MT) quantized rows of x: integer sums per super-block,
 * then d * dx * (sum - the mins' or Q6_K's offset part). Inlined into kq_rows_block's switch
 * with kind and mt constant. */
static inline __attribute__((always_inline)) void kq_rows_kernel(
    const int kind, const int mt, const uint8_t *w, int64_t row_bytes, int64_t nsb, int64_t n0,
    int64_t n1, const int8_t *xq, const float *xd, const int16_t *bs, int64_t K, float *y,
    int64_t N) {
    const int bb = kind == KIND_Q4_K ? 144 : kind == KIND_Q5_K ? 176 : 210;
    const int64_t ng = K / 16; /* activation sums a row */
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float out[KQ_MT] = {0};
#ifdef __AVX2__
        __m256 facc[KQ_MT];
        for (int i = 0; i < mt; i++) facc[i] = _mm256_setzero_ps();
#endif
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = row + b * bb;
            const int8_t *xb = xq + b * QK_K;
            const int16_t *sb = bs + b * 16;
            if (kind == KIND_Q6_K) {
                const int8_t *sc = (const int8_t *)(blk + 192);
                const float d = kq_f16(blk + 208);
                int offs[KQ_MT] = {0}; /* sum of sc * 32 * the codes' sums */
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < 16; j++) offs[i] += sc[j] * sb[i * ng + j];
#ifdef __AVX2__
                __m256i iacc[KQ_MT];
                for (int i = 0; i < mt; i++) iacc[i] = _mm256_setzero_si256();
                const __m256i low = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
                for (int r = 0; r < 2; r++) {
                    __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * r));
                    __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * r + 32));
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * r));
                    for (int k = 0; k < 4; k++) {
                        __m256i lsrc = k % 2 ? l1 : l0;
                        __m256i lo = _mm256_and_si256(k < 2 ? lsrc : _mm256_srli_epi16(lsrc, 4), low);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), three);
                        __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                        int s = 8 * r + 2 * k;
                        __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]),
                                                         _mm_set1_epi16(sc[s]));
                        for (int i = 0; i < mt; i++) {
                            __m256i xv = _mm256_loadu_si256(
                                (const __m256i *)(xb + i * K + 128 * r + 32 * k));
                            iacc[i] = _mm256_add_epi32(iacc[i], kq_dot32(q, xv, scale));
                        }
                    }
                }
                for (int i = 0; i < mt; i++) {
                    __m256 v = _mm256_cvtepi32_ps(iacc[i]);
                    float dx = d * xd[i * nsb + b];
                    facc[i] = _mm256_fmadd_ps(v, _mm256_set1_ps(dx), facc[i]);
                    out[i] -= dx * (float)(32 * offs[i]);
                }
#else
                for (int i = 0; i < mt; i++) {
                    int sum = 0;
                    for (int r = 0; r < 2; r++)
                        for (int k = 0; k < 4; k++)
                            for (int t = 0; t < 32; t++) {
                                int wi = 128 * r + 32 * k + t;
                                int lo = (blk[64 * r + 32 * (k % 2) + t] >> (4 * (k / 2))) & 15;
                                int hi = (blk[128 + 32 * r + t] >> (2 * k)) & 3;
                                sum += sc[wi / 16] * (lo | (hi << 4)) * xb[i * K + wi];
                            }
                    out[i] += d * xd[i * nsb + b] * (float)(sum - 32 * offs[i]);
                }
#endif
                continue;
            }
            const float d = kq_f16(blk), dmin = kq_f16(blk + 2);
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            const uint8_t *qh = blk + 16, *qs = blk + (kind == KIND_Q5_K ? 48 : 16);
            for (int i = 0; i < mt; i++) {
                int msum = 0;
                for (int j = 0; j < 8; j++) msum += mn[j] * (sb[i * ng + 2 * j] + sb[i * ng + 2 * j + 1]);
                out[i] -= dmin * xd[i * nsb + b] * (float)msum;
            }
#ifdef __AVX2__
            __m256i iacc[KQ_MT];
            for (int i = 0; i < mt; i++) iacc[i] = _mm256_setzero_si256();
            const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
            __m256i hbits = kind == KIND_Q5_K ? _mm256_loadu_si256((const __m256i *)qh)
                                              : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(raw, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                if (kind == KIND_Q5_K) {
                    __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c), one);
                    __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c + 1), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                }
                __m256i s0 = _mm256_set1_epi16(sc[2 * c]), s1 = _mm256_set1_epi16(sc[2 * c + 1]);
                for (int i = 0; i < mt; i++) {
                    const int8_t *xv = xb + i * K + 64 * c;
                    __m256i x0 = _mm256_loadu_si256((const __m256i *)xv);
                    __m256i x1 = _mm256_loadu_si256((const __m256i *)(xv + 32));
                    __m256i p = _mm256_add_epi32(kq_dot32(lo, x0, s0), kq_dot32(hi, x1, s1));
                    iacc[i] = _mm256_add_epi32(iacc[i], p);
                }
            }
            for (int i = 0; i < mt; i++) {
                __m256 v = _mm256_cvtepi32_ps(iacc[i]);
                facc[i] = _mm256_fmadd_ps(v, _mm256_set1_ps(d * xd[i * nsb + b]), facc[i]);
            }
#else
            for (int i = 0; i < mt; i++) {
                int sum = 0;
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++) {
                        int j = 2 * c + h, part = 0;
                        for (int t = 0; t < 32; t++) {
                            int q = (qs[32 * c + t] >> (4 * h)) & 15;
                            if (kind == KIND_Q5_K) q |= ((qh[t] >> j) & 1) << 4;
                            part += q * xb[i * K + 32 * j + t];
                        }
                        sum += sc[j] * part;
                    }
                out[i] += d * xd[i * nsb + b] * (float)sum;
            }
#endif
        }
#ifdef __AVX2__
        for (int i = 0; i < mt; i++) out[i] += hsum8(facc[i]);
#endif
        for (int i = 0; i < mt; i++) y[i * N + n] = out[i];
    }
}

#define KQ_CASE(KIND, MT_)                                                                     \
    case KIND * 8 + MT_:                                                                       \
        kq_rows_kernel(KIND, MT_, w, row_bytes, nsb, n0, n1, xq, xd, bs, K, y, N);             \
        break;
#define KQ_KIND(KIND) KQ_CASE(KIND, 1) KQ_CASE(KIND, 2) KQ_CASE(KIND, 3) KQ_CASE(KIND, 4)

static void kq_rows_block(int kind, const uint8_t *w, int64_t row_bytes, int64_t nsb,
                          int64_t n0, int64_t n1, int mt, const int8_t *xq, const float *xd,
                          const int16_t *bs, int64_t K, float *y, int64_t N) {
    switch (kind * 8 + mt) {
        KQ_KIND(KIND_Q4_K)
        KQ_KIND(KIND_Q5_K)
        KQ_KIND(KIND_Q6_K)
    }
}

#ifdef __AVX2__
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
/* VNNI (AVX-512 Xeons and EPYCs, AVX-VNNI cores): u8 x s8 products summed 4 to an int32 lane
 * in one instruction, where AVX2 takes maddubs into int16 and an add; the sub-block scales
 * then multiply int32 sums (mullo). A 6144 x 1024 Q4_Kx8 times 128 rows: 4.35 -> 3.77 ms on 2
 * threads (the prompt steps' kernel). */
#define KQ_VNNI 1
static inline __m256i kq_dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
#endif

/* rows [8 g0, 8 g1) of a Q4_Kx8 or Q5_Kx8 weight against mt (<= KQ_MT) quantized rows of
 * x. Per sub-block, rounds of maddubs sum in int16 (Q4_K: all 8, 8 x 2 x 15 x 127 < 32768;
 * Q5_K: 4 at a time, 4 x 2 x 31 x 127 < 32768), then one madd by the 8 rows' scales (each
 * lane's two halves the same scale) into int32. */
static inline __attribute__((always_inline)) void qkx8_kernel(
    const int base, const int mt, const uint8_t *w, int64_t nsb, int64_t g0, int64_t g1,
    const int8_t *xq, const float *xd, const int16_t *bs, int64_t K, float *y, int64_t N) {
    const int q5 = base == KIND_Q5_K;
    const int64_t gb = q5 ? GB_Q5_K : GB_Q4_K;
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    /* lane r: (scale of row r, 0, the same, 0) from the pairs' byte 2r (+1: the odd one) */
    const __m256i even = _mm256_setr_epi8(0, -1, 0, -1, 2, -1, 2, -1, 4, -1, 4, -1, 6, -1, 6, -1,
                                          8, -1, 8, -1, 10, -1, 10, -1, 12, -1, 12, -1, 14, -1, 14, -1);
    const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi16(1));
#ifdef KQ_VNNI /* lane r: (scale of row r, 0, 0, 0): an int32 */
    const __m256i even32 = _mm256_setr_epi8(0, -1, -1, -1, 2, -1, -1, -1, 4, -1, -1, -1, 6, -1, -1, -1,
                                            8, -1, -1, -1, 10, -1, -1, -1, 12, -1, -1, -1, 14, -1, -1, -1);
    const __m256i odd32 = _mm256_add_epi8(even32, _mm256_set1_epi32(1));
#endif
    const int64_t ng = K / 16;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *grp = w + g * nsb * gb;
        __m256 facc[KQ_MT];
        for (int i = 0; i < mt; i++) facc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = grp + b * gb, *codes = blk + (q5 ? 416 : 160);
            for (int64_t o = 0; o < gb; o += 64)
                _mm_prefetch((const char *)blk + KQ_PREFETCH + o, _MM_HINT_T0);
            __m256i acc[KQ_MT];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i pairs = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(blk + 32 + 32 * c)));
                for (int h = 0; h < 2; h++) {
#ifdef KQ_VNNI
                    __m256i scale = _mm256_shuffle_epi8(pairs, h ? odd32 : even32);
                    (void)even, (void)odd;
#else
                    __m256i scale = _mm256_shuffle_epi8(pairs, h ? odd : even);
#endif
                    for (int tq = 0; tq < 2; tq++) { /* Q4_K: both halves before the madd */
                        __m256i part[KQ_MT];
                        if (!q5 && tq == 1) continue;
                        for (int i = 0; i < mt; i++) part[i] = _mm256_setzero_si256();
                        __m256i hb = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 160 + 64 * c + 32 * tq))
                                        : _mm256_setzero_si256();
                        for (int t = q5 ? 4 * tq : 0; t < (q5 ? 4 * tq + 4 : 8); t++) {
                            __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + 32 * (8 * c + t)));
                            __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low);
                            if (q5) { /* bit 2 (t % 4) + h of each byte: the fifth */
                                __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * (t % 4) + h), one);
                                q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
                            }
                            for (int i = 0; i < mt; i++) {
                                int32_t x4;
                                memcpy(&x4, xq + i * K + b * QK_K + 64 * c + 32 * h + 4 * t, 4);
#ifdef KQ_VNNI
                                part[i] = kq_dpbusd(part[i], q, _mm256_set1_epi32(x4));
#else
                                part[i] = _mm256_add_epi16(part[i],
                                                           _mm256_maddubs_epi16(q, _mm256_set1_epi32(x4)));
#endif
                            }
                        }
                        for (int i = 0; i < mt; i++)
#ifdef KQ_VNNI
                            acc[i] = _mm256_add_epi32(acc[i], _mm256_mullo_epi32(part[i], scale));
#else
                            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(part[i], scale));
#endif
                    }
                }
            }
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            for (int i = 0; i < mt; i++) {
                /* the mins: per row, the sum over sub-blocks of min times the codes' sum */
                const int16_t *sb = bs + i * ng + b * 16;
                __m256i macc = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    __m256i mins = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(blk + 32 + 32 * c + 16)));
                    int32_t s0 = sb[4 * c] + sb[4 * c + 1], s1 = sb[4 * c + 2] + sb[4 * c + 3];
                    __m256i sums = _mm256_set1_epi32((int32_t)((uint32_t)(s0 & 0xffff) | ((uint32_t)s1 << 16)));
                    macc = _mm256_add_epi32(macc, _mm256_madd_epi16(mins, sums));
                }
                __m256 dx = _mm256_set1_ps(xd[i * nsb + b]);
                facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(d8, dx), facc[i]);
                facc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(macc), _mm256_mul_ps(dm8, dx), facc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + i * N + g * KQ_XR, facc[i]);
    }
}

/* rows [8 g0, 8 g1) of a Q6_Kx8 weight against mt (<= KQ_MT) quantized rows of x: each
 * round's maddubs (2 x 63 x 127 < 32768) madd-ed at once by its sub-block's scales; the -32
 * of every code is taken off at the end through the activations' sums. */
static inline __attribute__((always_inline)) void q6kx8_kernel(
    const int mt, const uint8_t *w, int64_t nsb, int64_t g0, int64_t g1, const int8_t *xq,
    const float *xd, const int16_t *bs, int64_t K, float *y, int64_t N) {
    const __m256i low = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    /* lane r of a pair vector holds (scale 2u, scale 2u + 1) as int16: each one twice */
    const __m256i dup0 = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                          0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i dup1 = _mm256_add_epi8(dup0, _mm256_set1_epi8(2));
    const int64_t ng = K / 16;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *grp = w + g * nsb * GB_Q6_K;
        __m256 facc[KQ_MT];
        for (int i = 0; i < mt; i++) facc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = grp + b * GB_Q6_K, *codes = blk + 144;
            for (int64_t o = 0; o < GB_Q6_K; o += 64)
                _mm_prefetch((const char *)blk + KQ_PREFETCH + o, _MM_HINT_T0);
            __m256i acc[KQ_MT];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_si256();
            for (int tq = 0; tq < 4; tq++) { /* sub-blocks tq, 4 + tq, 8 + tq, 12 + tq */
                __m256i scale[4];
                for (int j = 0; j < 4; j++) {
                    __m256i pairs = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(blk + 16 + 16 * (2 * j + tq / 2))));
#ifdef KQ_VNNI /* lane r: row r's scale as an int32 */
                    scale[j] = tq % 2 ? _mm256_srai_epi32(pairs, 16)
                                      : _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16);
                    (void)dup0, (void)dup1;
#else
                    scale[j] = _mm256_shuffle_epi8(pairs, tq % 2 ? dup1 : dup0);
#endif
                }
#ifdef KQ_VNNI
                __m256i part[4][KQ_MT];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < mt; i++) part[j][i] = _mm256_setzero_si256();
#endif
                for (int tt = 0; tt < 4; tt++) {
                    const int t = 4 * tq + tt;
                    __m256i l0 = _mm256_loadu_si256((const __m256i *)(codes + 96 * t));
                    __m256i l1 = _mm256_loadu_si256((const __m256i *)(codes + 96 * t + 32));
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(codes + 96 * t + 64));
                    for (int j = 0; j < 4; j++) {
                        __m256i lsrc = j < 2 ? l0 : l1;
                        __m256i lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(lsrc, 4) : lsrc, low);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), three);
                        __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                        for (int i = 0; i < mt; i++) {
                            int32_t x4;
                            memcpy(&x4, xq + i * K + b * QK_K + 64 * j + 4 * t, 4);
#ifdef KQ_VNNI
                            part[j][i] = kq_dpbusd(part[j][i], q, _mm256_set1_epi32(x4));
#else
                            __m256i p = _mm256_maddubs_epi16(q, _mm256_set1_epi32(x4));
                            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, scale[j]));
#endif
                        }
                    }
                }
#ifdef KQ_VNNI
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < mt; i++)
                        acc[i] = _mm256_add_epi32(acc[i], _mm256_mullo_epi32(part[j][i], scale[j]));
#endif
            }
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            for (int i = 0; i < mt; i++) {
                const int16_t *sb = bs + i * ng + b * 16;
                __m256i off = _mm256_setzero_si256();
                for (int u = 0; u < 8; u++) {
                    __m256i pairs = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(blk + 16 + 16 * u)));
                    __m256i sums = _mm256_set1_epi32(
                        (int32_t)((uint32_t)(uint16_t)sb[2 * u] | ((uint32_t)(uint16_t)sb[2 * u + 1] << 16)));
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(pairs, sums));
                }
                __m256i total = _mm256_sub_epi32(acc[i], _mm256_slli_epi32(off, 5));
                __m256 dx = _mm256_set1_ps(xd[i * nsb + b]);
                facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d8, dx), facc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + i * N + g * KQ_XR, facc[i]);
    }
}

#define KQX8_CASE(KIND, FN, MT_)                                                               \
    case KIND * 8 + MT_:                                                                       \
        FN(MT_, w, nsb, g0, g1, xq, xd, bs, K, y, N);                                          \
        break;
#define KQX8_KIND(KIND, FN)                                                                    \
    KQX8_CASE(KIND, FN, 1) KQX8_CASE(KIND, FN, 2) KQX8_CASE(KIND, FN, 3) KQX8_CASE(KIND, FN, 4)
#define q4kx8_kernel(...) qkx8_kernel(KIND_Q4_K, __VA_ARGS__)
#define q5kx8_kernel(...) qkx8_kernel(KIND_Q5_K, __VA_ARGS__)

static int kq_groups_block(int kind, const uint8_t *w, int64_t nsb, int64_t g0, int64_t g1,
                           int mt, const int8_t *xq, const float *xd, const int16_t *bs,
                           int64_t K, float *y, int64_t N) {
    switch (kind * 8 + mt) {
        KQX8_KIND(KIND_Q4_KX8, q4kx8_kernel)
        KQX8_KIND(KIND_Q5_KX8, q5kx8_kernel)
        KQX8_KIND(KIND_Q6_KX8, q6kx8_kernel)
    }
    return 0;
}
#else
/* without AVX2: each group's rows back in the file's form, through the row kernel */
static int kq_groups_block(int kind, const uint8_t *w, int64_t nsb, int64_t g0, int64_t g1,
                           int mt, const int8_t *xq, const float *xd, const int16_t *bs,
                           int64_t K, float *y, int64_t N) {
    const int base = kq_base(kind);
    const int64_t bb = hx_kq_block_bytes(base), gb = kq_group_bytes(base);
    uint8_t *rows = malloc((size_t)(KQ_XR * nsb * bb));
    float *part = malloc((size_t)(mt * KQ_XR) * sizeof(float));
    if (!rows || !part) {
        free(rows);
        free(part);
        return -1;
    }
    for (int64_t g = g0; g < g1; g++) {
        for (int r = 0; r < KQ_XR; r++)
            for (int64_t b = 0; b < nsb; b++)
                group_row_k(base, w + (g * nsb + b) * gb, r, rows + (r * nsb + b) * bb);
        kq_rows_block(base, rows, nsb * bb, nsb, 0, KQ_XR, mt, xq, xd, bs, K, part, KQ_XR);
        for (int i = 0; i < mt; i++) memcpy(y + i * N + g * KQ_XR, part + i * KQ_XR, KQ_XR * sizeof(float));
    }
    free(rows);
    free(part);
    return 0;
}
#endif

static int kq_check(int kind, int64_t N, int64_t K) {
    int ok = hx_kq_is_kind(kind) && N >= 1 && K >= QK_K && K % QK_K == 0;
    return ok && (!kq_is_x8(kind) || N % KQ_XR == 0) ? 0 : -1;
}

/* y [M, N] = x [M, K] @ W^T, x quantized to int8 per 256 (decode's path). Returns 0, or -1
 * on a bad argument or a failed allocation. */
int hx_kq_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                 float *y, int num_threads) {
    if (kq_check(kind, N, K) || M < 1) return -1;
    int64_t nsb = K / QK_K, row_bytes = nsb * hx_kq_block_bytes(kind);
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc((size_t)(M * nsb) * sizeof(float));
    int16_t *bs = malloc((size_t)(M * (K / 16)) * sizeof(int16_t));
    if (!xq || !xd || !bs) {
        free(xq); free(xd); free(bs);
        return -1;
    }
    kq_quantize_x(x, M, K, xq, xd, bs);
    if (kq_is_x8(kind)) { /* groups of 8 rows in chunks of 2, split over the threads */
        int64_t ng = N / KQ_XR, nc = (ng + 1) / 2;
        int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t c = 0; c < nc; c++) {
            int64_t g0 = 2 * c, g1 = g0 + 2 < ng ? g0 + 2 : ng;
            for (int64_t m0 = 0; m0 < M; m0 += KQ_MT) {
                int mt = M - m0 < KQ_MT ? (int)(M - m0) : KQ_MT;
                if (kq_groups_block(kind, w, nsb, g0, g1, mt, xq + m0 * K, xd + m0 * nsb,
                                    bs + m0 * (K / 16), K, y + m0 * N, N)) {
#pragma omp atomic write
                    failed = 1;
                }
            }
        }
        free(xq); free(xd); free(bs);
        return failed ? -1 : 0;
    }
    int64_t nchunks = (N + KQ_CHUNK - 1) / KQ_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t n0 = c * KQ_CHUNK, n1 = n0 + KQ_CHUNK < N ? n0 + KQ_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += KQ_MT) {
            int mt = M - m0 < KQ_MT ? (int)(M - m0) : KQ_MT;
            kq_rows_block(kind, w, row_bytes, nsb, n0, n1, mt, xq + m0 * K, xd + m0 * nsb,
                          bs + m0 * (K / 16), K, y + m0 * N, N);
        }
    }
    free(xq); free(xd); free(bs);
    return 0;
}


/* y [M, N] = x [M, K] @ W^T with x in float32 as it is: each row of W widened to its exact
 * floats once and multiplied into every row of x (prompt steps' few-row calls, as
 * hx_blocks_matmul_f32 for the 32-weight kinds). */
int hx_kq_matmul_f32(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x,
                     int64_t M, float *y, int num_threads) {
    if (kq_check(kind, N, K) || M < 1) return -1;
    int64_t nsb = K / QK_K;
    int failed = 0;
    if (kq_is_x8(kind)) { /* a group's super-block widened once for every row of x */
        const int base = kq_base(kind);
        const int64_t gb = kq_group_bytes(base);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < N / KQ_XR; g++) {
            float buf[8 * QK_K];
            for (int64_t m0 = 0; m0 < M; m0 += KQ_MT) {
                int mt = M - m0 < KQ_MT ? (int)(M - m0) : KQ_MT;
#ifdef __AVX2__
                __m256 acc[KQ_MT], acc2[KQ_MT];
                for (int i = 0; i < mt; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
#else
                float acc[KQ_MT][KQ_XR] = {{0}};
#endif
                for (int64_t b = 0; b < nsb; b++) {
                    kq_x8_unpack(base, w + (g * nsb + b) * gb, buf);
                    for (int i = 0; i < mt; i++) {
                        const float *xi = x + (m0 + i) * K + b * QK_K;
#ifdef __AVX2__
                        for (int p = 0; p < QK_K; p += 2) { /* two chains: FMA latency */
                            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + 8 * p),
                                                     _mm256_broadcast_ss(xi + p), acc[i]);
                            acc2[i] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + 8 * p + 8),
                                                      _mm256_broadcast_ss(xi + p + 1), acc2[i]);
                        }
#else
                        for (int p = 0; p < QK_K; p++)
                            for (int r = 0; r < KQ_XR; r++) acc[i][r] += buf[8 * p + r] * xi[p];
#endif
                    }
                }
                for (int i = 0; i < mt; i++) {
#ifdef __AVX2__
                    _mm256_storeu_ps(y + (m0 + i) * N + g * KQ_XR, _mm256_add_ps(acc[i], acc2[i]));
#else
                    memcpy(y + (m0 + i) * N + g * KQ_XR, acc[i], KQ_XR * sizeof(float));
#endif
                }
            }
        }
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
        float *wr = malloc((size_t)K * sizeof(float));
        if (!wr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!wr) continue;
            uint8_t tmp[256];
            for (int64_t b = 0; b < nsb; b++)
                kq_dequant(kq_base(kind), file_block(kind, w, nsb, n, b, tmp), wr + b * QK_K);
            for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(wr, x + m * K, K);
        }
        free(wr);
    }
    return failed ? -1 : 0;
}

/* out [N, K] float32 = the weight (dequant.py's arithmetic) */
int hx_kq_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                     int num_threads) {
    if (kq_check(kind, N, K)) return -1;
    int64_t nsb = K / QK_K;
    if (kq_is_x8(kind)) {
        const int base = kq_base(kind);
        const int64_t gb = kq_group_bytes(base);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < N / KQ_XR; g++) {
            float buf[8 * QK_K];
            for (int64_t b = 0; b < nsb; b++) {
                kq_x8_unpack(base, w + (g * nsb + b) * gb, buf);
                for (int r = 0; r < KQ_XR; r++) {
                    float *o = out + (g * KQ_XR + r) * K + b * QK_K;
                    for (int p = 0; p < QK_K; p++) o[p] = buf[8 * p + r];
                }
            }
        }
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        uint8_t tmp[256];
        for (int64_t b = 0; b < nsb; b++)
            kq_dequant(kq_base(kind), file_block(kind, w, nsb, n, b, tmp), out + n * K + b * QK_K);
    }
    return 0;
}

/* out [K, N] float32 = the weight transposed: what a prompt chunk's GEMM takes as x @ out.
 * Threads split the super-blocks along K, so that each writes whole rows of out. */
int hx_kq_dequantize_t(int kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                       int num_threads) {
    if (kq_check(kind, N, K)) return -1;
    int64_t nsb = K / QK_K;
    if (kq_is_x8(kind)) { /* each group's 8 outputs of a position are 8 floats side by side */
        const int base = kq_base(kind);
        const int64_t gb = kq_group_bytes(base);
        /* a quarter of a super-block at a time: 64 rows of out written along, not 256 */
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t bq = 0; bq < 4 * nsb; bq++) {
            float *o = out + bq * 64 * N;
            for (int64_t g = 0; g < N / KQ_XR; g++)
                kq_x8_quarter(base, w + (g * nsb + bq / 4) * gb, (int)(bq % 4), o + g * KQ_XR, N);
        }
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < nsb; b++) {
        float v[QK_K];
        uint8_t tmp[256];
        float *o = out + b * QK_K * N;
        for (int64_t n = 0; n < N; n++) {
            kq_dequant(kq_base(kind), file_block(kind, w, nsb, n, b, tmp), v);
            for (int j = 0; j < QK_K; j++) o[j * N + n] = v[j];
        }
    }
    return 0;
}

/* out [n, K] float32 = rows ids[0..n) of the weight (a tied embedding's lookup) */
int hx_kq_rows(int kind, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n,
               float *out) {
    if (kq_check(kind, N, K)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    int64_t nsb = K / QK_K;
    uint8_t tmp[256];
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < nsb; b++)
            kq_dequant(kq_base(kind), file_block(kind, w, nsb, ids[i], b, tmp), out + i * K + b * QK_K);
    return 0;
}
