/*
 * Many-row products over GGUF block-quantized weights on AVX512-VNNI (prefill chunks, large
 * decode batches): out = x @ W^T (+ bias), x's rows quantized to int8 as for quant_legacy.c's
 * and quant_kquants.c's kernels (one scale per 32 values, per 256 for the K-quants), the
 * weights' integer values unpacked a panel of 32 weight rows at a time into a layout where one
 * vpdpbusd multiplies 16 of them by 4 values of one row of x.
 *
 * quant_legacy.c's tiles take a weight row against a row of x, two blocks per vpdpbusd, and
 * pay a scale product and a convert per pair of blocks and row: about 3 instructions per 64
 * products, no faster than a bf16 GEMM. Here a vector holds 16 weight rows (the panel's
 * columns of the output), 4 consecutive values each; a row of x's 4 values, broadcast, meet
 * them in one vpdpbusd; 8 of those sum a sub-block of 32 values in int32 for 16 outputs, then
 * one convert, one scale product and one FMA take it into the fp32 sums: 11 instructions per
 * 512 products, and the weights' integers are read from L2 once per 4 rows of x.
 *
 * Every format becomes the same panel (`unpack_block`): unsigned values u (0..255) per weight,
 * and per sub-block s of SB values (32; Q6_K's 16) a scale d_s, and for formats with a
 * minimum a term m_s, with weight = d_s * (u - o) + m_s for the format's integer offset o
 * (Q8_0: u = q + 128, o = 128; Q4_0: 8; Q5_0: 16; Q6_K: 32; else 0). With A_s the sum of x's
 * int8 values over the sub-block and da its block's scale, a sub-block contributes
 *     da * d_s * (sum u a - o * A_s) + m_s * da * A_s,
 * the first sum in int32 (vpdpbusd: u unsigned, a signed; it starts from -o * A_s), the rest
 * in fp32. The integer dots are those of quant_legacy.c's and quant_kquants.c's kernels
 * (Q6_K's scales apply per 16 values, as ggml's); only the order of the fp32 sums differs.
 *
 * Work: panels of 32 weight rows split between OpenMP threads. A thread unpacks its panel's
 * rows into bytes (plain loops GCC vectorizes), transposes them 16 rows by 4 values at a time
 * into the panel (32 x K bytes, in L2), then runs every 4 rows of x over it.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "kquant_blocks.h"
#include "linear.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_GEMM 1
#endif

#ifdef HAVE_GEMM

#define PANEL 32  /* weight rows per panel: two vectors of 16 */
#define TILE_R 4  /* rows of x per tile */
#define GROUP 128 /* bytes of a panel per 4 values: PANEL x 4 */
/* Values of K unpacked at a time (a multiple of every block): the chunk of the panel (32 KB),
 * its unpacked rows (32 KB) and the 4 rows of x stay in L1 / L2 while every row of x runs
 * over it. Whole rows of K = 8192 (256 KB of panel and as much unpacked) ran at 0.6-0.7x the
 * speed of K = 2048's on the same number of products. */
#define KC 1024

/* Per format code (quant_formats.FORMATS): values and bytes per block, sub-block values,
 * the integer offset o, whether there is a minimum term. */
struct fmt_info {
    int values, bytes, sub, offset, has_min;
};
static const struct fmt_info FMT[AE_QUANT_FORMATS] = {
    {32, 34, 32, 128, 0}, {32, 18, 32, 8, 0},   {32, 20, 32, 0, 1},   {32, 22, 32, 16, 0},
    {32, 24, 32, 0, 1},   {256, 144, 32, 0, 1}, {256, 176, 32, 0, 1}, {256, 210, 16, 32, 0},
    {256, 144, 32, 0, 1}, /* Q4_K_R8: read 8 rows at a time (unpack_group_r8) */
    {32, 34, 32, 128, 0}, /* Q8_0_R8: the same (unpack_group_q8r8) */
    {32, 22, 32, 16, 0},  /* Q5_0_R8, Q4_0_R8: the same (unpack_group_q50r8) */
    {32, 18, 32, 8, 0},
    {256, 210, 16, 32, 0}, /* Q6_K_R8: the same (unpack_group_q6kr8) */
};

static inline float f16_at(const uint8_t *p) {
    _Float16 v;
    memcpy(&v, p, 2);
    return (float)v;
}

/* One block of format `fmt` at b: its values' u into u (values bytes), each sub-block's d_s
 * into sc and m_s into mn (formats with a minimum). As ggml's dequantize_row_<type> reads
 * the block (quant_dequant.c; the K-quants through kquant_blocks.h). */
static ALWAYS_INLINE void unpack_block(const int fmt, const uint8_t *restrict b,
                                       uint8_t *restrict u, float *restrict sc,
                                       float *restrict mn) {
    switch (fmt) {
    case 0: /* Q8_0: d, qs[32] */
        sc[0] = f16_at(b);
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)(b[2 + j] ^ 0x80);
        break;
    case 1:   /* Q4_0: d, qs[16] */
    case 2:   /* Q4_1: d, m, qs[16] */
    case 3:   /* Q5_0: d, qh, qs[16] */
    case 4: { /* Q5_1: d, m, qh, qs[16]. The low nibbles are elements 0-15, the high ones
               * 16-31; qh's bit j is element j's fifth bit. */
        const int m = fmt == 2 || fmt == 4, h = fmt == 3 || fmt == 4;
        sc[0] = f16_at(b);
        if (m) mn[0] = f16_at(b + 2);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * m + 4 * h));
        const __m128i m4 = _mm_set1_epi8(15);
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4),
                                     _mm_and_si128(raw, m4));
        if (h) {
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * m, 4);
            q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
        }
        _mm256_storeu_si256((__m256i *)u, q);
        break;
    }
    case 5: /* Q4_K, Q5_K: d, dmin, the 12 scale bytes, (Q5_K: qh[32],) qs[128] */
    case 6: {
        const float d = f16_at(b), dmin = f16_at(b + 2);
        uint8_t s[8], m[8];
        k4_scales(b + 4, s, m);
        for (int j = 0; j < 8; j++) {
            sc[j] = d * (float)s[j];
            mn[j] = -dmin * (float)m[j];
        }
        unpack_sb(fmt, b, u);
        break;
    }
    case 7: { /* Q6_K: ql[128], qh[64], scales[16] (int8), d; 16-value group t's scale is t's */
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        for (int t = 0; t < 16; t++) sc[t] = d * (float)scales[t];
        unpack_sb(fmt, b, u);
        break;
    }
    }
}

/* Weight row w (nb blocks) unpacked: its u into u (K bytes), its d_s and m_s into column
 * `col` of the panel's sc and mn ([S][PANEL]). One function per format, so that each
 * unpack_block loop is compiled (and vectorized) for its format. */
#define UNPACK_ROW_FN(f)                                                                    \
    static void unpack_row_##f(const uint8_t *restrict w, int64_t nb, uint8_t *restrict u,   \
                               float *restrict sc, float *restrict mn, int col) {           \
        const struct fmt_info fi = FMT[f];                                                  \
        const int subs = fi.values / fi.sub;                                                \
        float s[16], m[16];                                                                 \
        for (int64_t i = 0; i < nb; i++) {                                                  \
            unpack_block(f, w + i * fi.bytes, u + i * fi.values, s, m);                     \
            for (int t = 0; t < subs; t++) {                                                \
                sc[(i * subs + t) * PANEL + col] = s[t];                                    \
                if (fi.has_min) mn[(i * subs + t) * PANEL + col] = m[t];                    \
            }                                                                               \
        }                                                                                   \
    }
UNPACK_ROW_FN(0)
UNPACK_ROW_FN(1)
UNPACK_ROW_FN(2)
UNPACK_ROW_FN(3)
UNPACK_ROW_FN(4)
UNPACK_ROW_FN(5)
UNPACK_ROW_FN(6)
UNPACK_ROW_FN(7)

/* Rows 8g..8g+7 of Q4_K_R8 weights w (nsb super-blocks a row), their super-blocks b0 .. b0 +
 * nb - 1, as unpack_row_5 unpacks 8 Q4_K rows: values into u (row stride ld), d_s and m_s
 * into columns col..col+7 of sc and mn. A chunk's low nibbles hold in 64-bit lane r row r's
 * 8 values of its first step, the high nibbles those of the second (quant_r8.c). */
static void unpack_group_r8(const uint8_t *restrict w, int64_t g, int64_t nsb, int64_t b0,
                            int64_t nb, uint8_t *restrict u, int64_t ld, float *restrict sc,
                            float *restrict mn, int col) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + (g * nsb + b0 + i) * Q4K_R8_BYTES;
        for (int c = 0; c < 16; c++) {
            const __m512i P = _mm512_loadu_si512(blk + 128 + 64 * c);
            const __m512i lo = _mm512_and_si512(P, m4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
            /* 128-bit lane k: rows 2k (unpacklo) and 2k + 1 (unpackhi), 16 values each */
            uint8_t rows[2][64] __attribute__((aligned(64)));
            _mm512_store_si512(rows[0], _mm512_unpacklo_epi64(lo, hi));
            _mm512_store_si512(rows[1], _mm512_unpackhi_epi64(lo, hi));
            for (int r = 0; r < 8; r++)
                memcpy(u + r * ld + i * 256 + 16 * c, rows[r % 2] + 16 * (r / 2), 16);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        uint8_t s[8], m[8];
        /* the 8 rows' 6-bit scales and mins (few beside the values) */
        for (int j = 0; j < 8; j++) {
            for (int r = 0; r < 8; r++) q4k_r8_scale_min(blk, 8 * j + r, &s[r], &m[r]);
            const __m256 sv =
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)));
            const __m256 mv =
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)));
            _mm256_storeu_ps(sc + (i * 8 + j) * PANEL + col, _mm256_mul_ps(d, sv));
            _mm256_storeu_ps(mn + (i * 8 + j) * PANEL + col,
                             _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mv)));
        }
    }
}

/* Rows u + r * ld (r < 8) get 4 steps' values each, in step order, from `steps` (4 x 64
 * bytes, 64-bit lane r of a step being row r's 8 values of it: the 8-row layouts' lanes). */
static ALWAYS_INLINE void copy_lanes(const uint8_t *steps, uint8_t *restrict u, int64_t ld) {
    for (int r = 0; r < 8; r++)
        for (int t = 0; t < 4; t++) memcpy(u + r * ld + 8 * t, steps + 64 * t + 8 * r, 8);
}

/* copy_lanes of 4 steps held in registers */
static ALWAYS_INLINE void store_lanes(const __m512i v[4], uint8_t *restrict u, int64_t ld) {
    uint8_t steps[4][64] __attribute__((aligned(64)));
    for (int t = 0; t < 4; t++) _mm512_store_si512(steps[t], v[t]);
    copy_lanes(steps[0], u, ld);
}

/* Rows 8g..8g+7 of Q8_0_R8 weights w (nb blocks a row), their blocks b0 .. b0 + n - 1, as
 * unpack_row_0 unpacks 8 Q8_0 rows: 64-bit lane r of chunk s is row r's u of values 8s..8s+7
 * (q + 128 already, quant_r8.c). */
static void unpack_group_q8r8(const uint8_t *restrict w, int64_t g, int64_t nb, int64_t b0,
                              int64_t n, uint8_t *restrict u, int64_t ld, float *restrict sc,
                              int col) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *blk = w + (g * nb + b0 + i) * Q8R8_BYTES;
        copy_lanes(blk + 16, u + i * 32, ld);
        const __m128i d = _mm_loadu_si128((const __m128i *)blk);
        _mm256_storeu_ps(sc + i * PANEL + col, _mm256_cvtph_ps(d));
    }
}

/* Rows 8g..8g+7 of Q5_0_R8 (hb 1) or Q4_0_R8 (hb 0) weights w, their blocks b0 .. b0 + n - 1,
 * as unpack_row_3 / unpack_row_1 unpack 8 rows: u = q + 16 (q + 8), the blocks' d. Chunk c
 * holds steps 2c (low nibbles) and 2c + 1 (high), each in Q8_0_R8's lanes; step s's fifth
 * bits are the 64-bit mask at 144 + 8s, bit p for byte p of its step. */
static void unpack_group_q50r8(const uint8_t *restrict w, int64_t g, int64_t nb, int64_t b0,
                               int64_t n, uint8_t *restrict u, int64_t ld, float *restrict sc,
                               int col, int hb) {
    const int64_t gb = hb ? Q50R8_BYTES : Q40R8_BYTES;
    const __m512i m4 = _mm512_set1_epi8(15), b4 = _mm512_set1_epi8(16);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *blk = w + (g * nb + b0 + i) * gb;
        __m512i v[4];
        for (int c = 0; c < 2; c++) {
            const __m512i P = _mm512_loadu_si512(blk + 16 + 64 * c);
            v[2 * c] = _mm512_and_si512(P, m4);
            v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
        }
        if (hb)
            for (int s = 0; s < 4; s++) {
                uint64_t bits;
                memcpy(&bits, blk + 144 + 8 * s, 8);
                v[s] = _mm512_or_si512(v[s], _mm512_maskz_mov_epi8((__mmask64)bits, b4));
            }
        store_lanes(v, u + i * 32, ld);
        const __m128i d = _mm_loadu_si128((const __m128i *)blk);
        _mm256_storeu_ps(sc + i * PANEL + col, _mm256_cvtph_ps(d));
    }
}

/* Rows 8g..8g+7 of Q6_K_R8 weights w (nsb super-blocks a row), their super-blocks b0 ..
 * b0 + n - 1, as unpack_row_7 unpacks 8 Q6_K rows: u = q + 32, d times each 16 values' scale.
 * Part p holds steps 4p .. 4p + 3: their low 4 bits in its two low chunks (low nibbles the
 * even step), their high 2 bits at bits 2 (t % 4) of its high chunk (kquant_blocks.h). */
static void unpack_group_q6kr8(const uint8_t *restrict w, int64_t g, int64_t nsb, int64_t b0,
                               int64_t n, uint8_t *restrict u, int64_t ld, float *restrict sc,
                               int col) {
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3 << 4);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *blk = w + (g * nsb + b0 + i) * Q6KR8_BYTES;
        for (int p = 0; p < 8; p++) {
            const __m512i L0 = _mm512_loadu_si512(blk + q6kr8_low(2 * p));
            const __m512i L1 = _mm512_loadu_si512(blk + q6kr8_low(2 * p + 1));
            const __m512i H = _mm512_loadu_si512(blk + q6kr8_high(p));
            /* the high bits of step 4p + k, moved to bits 4-5 */
            const __m512i h0 = _mm512_and_si512(_mm512_slli_epi16(H, 4), m3);
            const __m512i h1 = _mm512_and_si512(_mm512_slli_epi16(H, 2), m3);
            const __m512i h2 = _mm512_and_si512(H, m3);
            const __m512i h3 = _mm512_and_si512(_mm512_srli_epi16(H, 2), m3);
            const __m512i v[4] = {
                _mm512_or_si512(_mm512_and_si512(L0, m4), h0),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), m4), h1),
                _mm512_or_si512(_mm512_and_si512(L1, m4), h2),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), m4), h3),
            };
            store_lanes(v, u + i * 256 + 32 * p, ld);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int t = 0; t < 16; t++) { /* scale t of the 8 rows: 8 bytes at 16 + 8t */
            const __m128i s8 = _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * t));
            const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
            _mm256_storeu_ps(sc + (i * 16 + t) * PANEL + col, _mm256_mul_ps(d, sv));
        }
    }
}

static void unpack_row(int fmt, const uint8_t *w, int64_t nb, uint8_t *u, float *sc, float *mn,
                       int col) {
    switch (fmt) {
    case 0: unpack_row_0(w, nb, u, sc, mn, col); break;
    case 1: unpack_row_1(w, nb, u, sc, mn, col); break;
    case 2: unpack_row_2(w, nb, u, sc, mn, col); break;
    case 3: unpack_row_3(w, nb, u, sc, mn, col); break;
    case 4: unpack_row_4(w, nb, u, sc, mn, col); break;
    case 5: unpack_row_5(w, nb, u, sc, mn, col); break;
    case 6: unpack_row_6(w, nb, u, sc, mn, col); break;
    default: unpack_row_7(w, nb, u, sc, mn, col); break;
    }
}

/* 16 rows of u (row stride K) by 16 values from k into the panel: group g of 4 values of
 * row i goes to bytes 4 i of dst + g * GROUP (dst: the panel's group k / 4, plus 64 for its
 * second half of rows). A 16 x 4 transpose of dwords: lane L of z[i] holds row 4 L + i. */
static inline void transpose_16(const uint8_t *u, int64_t K, uint8_t *dst) {
    __m512i z[4];
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(u + i * K)));
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(u + (i + 4) * K)), 1);
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(u + (i + 8) * K)), 2);
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(u + (i + 12) * K)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    _mm512_store_si512((__m512i *)dst, _mm512_unpacklo_epi64(t0, t2));
    _mm512_store_si512((__m512i *)(dst + GROUP), _mm512_unpackhi_epi64(t0, t2));
    _mm512_store_si512((__m512i *)(dst + 2 * GROUP), _mm512_unpacklo_epi64(t1, t3));
    _mm512_store_si512((__m512i *)(dst + 3 * GROUP), _mm512_unpackhi_epi64(t1, t3));
}

/* What the rows of x bring to a product: their int8 values and block scales, and per
 * sub-block the start of the integer sum (-o * A_s) and, for formats with a minimum, da * A_s. */
struct rows {
    const int8_t *qa; /* [M][K] */
    const float *da;  /* [M][K / 32] */
    const int32_t *init; /* [M][S] */
    const float *fa;  /* [M][S] */
    int64_t K, S;
};

/* R rows of x (from row m) over the panel's values k0 .. k0 + kc: res[r][0..31] (row stride
 * PANEL) = their fp32 sums, added to what res holds unless `first`. With KQ (the K-quants: one
 * activation scale per 256 values), a super-block's sub-blocks are summed times d_s first and
 * multiplied by da once, at its end: one product fewer per sub-block. */
static ALWAYS_INLINE void tile(const int R, const int SB, const int has_min, const int KQ,
                               const uint8_t *restrict panel, const float *restrict sc,
                               const float *restrict mn, const struct rows *x, int64_t m,
                               int64_t k0, int64_t kc, int first, float *restrict res) {
    const int64_t K = x->K, S = x->S, nb = K / 32, s0 = k0 / SB;
    const int per_da = KQ ? 256 / SB : 1; /* sub-blocks under one activation scale */
    const int8_t *qa = x->qa + m * K + k0;
    const float *da = x->da + m * nb + k0 / 32, *fa = x->fa ? x->fa + m * S + s0 : NULL;
    const int32_t *init = x->init + m * S + s0;
    __m512 acc[TILE_R][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(res + r * PANEL);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(res + r * PANEL + 16);
    }
    for (int64_t sd = 0; sd < kc / SB; sd += per_da) {
        __m512 part[TILE_R][2]; /* KQ: the super-block's sum of d_s * the integer sums */
        for (int r = 0; r < R; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
        for (int64_t s = sd; s < sd + per_da; s++) {
            __m512i sum[TILE_R][2];
            for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm512_set1_epi32(init[r * S + s]);
            const uint8_t *p = panel + s * (SB / 4) * GROUP;
            const int8_t *a = qa + s * SB;
            for (int g = 0; g < SB / 4; g++) {
                const __m512i w0 = _mm512_load_si512((const __m512i *)(p + g * GROUP));
                const __m512i w1 = _mm512_load_si512((const __m512i *)(p + g * GROUP + 64));
                for (int r = 0; r < R; r++) {
                    int32_t a4;
                    memcpy(&a4, a + r * K + 4 * g, 4);
                    const __m512i ab = _mm512_set1_epi32(a4);
                    sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], w0, ab);
                    sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], w1, ab);
                }
            }
            const __m512 d0 = _mm512_load_ps(sc + s * PANEL);
            const __m512 d1 = _mm512_load_ps(sc + s * PANEL + 16);
            for (int r = 0; r < R; r++) {
                if (KQ) {
                    part[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), d0, part[r][0]);
                    part[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), d1, part[r][1]);
                    continue;
                }
                const __m512 db = _mm512_set1_ps(da[r * nb + s * SB / 32]);
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(d0, db),
                                            acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), _mm512_mul_ps(d1, db),
                                            acc[r][1]);
            }
            if (has_min) {
                const __m512 m0 = _mm512_load_ps(mn + s * PANEL);
                const __m512 m1 = _mm512_load_ps(mn + s * PANEL + 16);
                for (int r = 0; r < R; r++) {
                    const __m512 f = _mm512_set1_ps(fa[r * S + s]);
                    acc[r][0] = _mm512_fmadd_ps(m0, f, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(m1, f, acc[r][1]);
                }
            }
        }
        if (KQ)
            for (int r = 0; r < R; r++) {
                const __m512 db = _mm512_set1_ps(da[r * nb + sd * SB / 32]);
                acc[r][0] = _mm512_fmadd_ps(part[r][0], db, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(part[r][1], db, acc[r][1]);
            }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(res + r * PANEL, acc[r][0]);
        _mm512_storeu_ps(res + r * PANEL + 16, acc[r][1]);
    }
}

/* One function per (rows, sub-block, minimum, K-quant): the loops above fully unrolled for
 * each. */
#define TILE_FN(R, SB, MIN, KQ)                                                             \
    static __attribute__((noinline)) void tile_##R##_##SB##_##MIN##_##KQ(                   \
        const uint8_t *p, const float *sc, const float *mn, const struct rows *x, int64_t m, \
        int64_t k0, int64_t kc, int first, float *res) {                                    \
        tile(R, SB, MIN, KQ, p, sc, mn, x, m, k0, kc, first, res);                          \
    }
#define TILE_FNS(SB, MIN, KQ) TILE_FN(1, SB, MIN, KQ) TILE_FN(2, SB, MIN, KQ) \
    TILE_FN(3, SB, MIN, KQ) TILE_FN(4, SB, MIN, KQ)
TILE_FNS(32, 0, 0)
TILE_FNS(32, 1, 0)
TILE_FNS(32, 1, 1)
TILE_FNS(16, 0, 1)

typedef void (*tile_fn)(const uint8_t *, const float *, const float *, const struct rows *,
                        int64_t, int64_t, int64_t, int, float *);
static tile_fn tile_for(int R, int SB, int has_min, int kq) {
    static const tile_fn fns[4][4] = {
        {tile_1_32_0_0, tile_2_32_0_0, tile_3_32_0_0, tile_4_32_0_0},
        {tile_1_32_1_0, tile_2_32_1_0, tile_3_32_1_0, tile_4_32_1_0},
        {tile_1_32_1_1, tile_2_32_1_1, tile_3_32_1_1, tile_4_32_1_1},
        {tile_1_16_0_1, tile_2_16_0_1, tile_3_16_0_1, tile_4_16_0_1},
    };
    return fns[SB == 16 ? 3 : kq ? 2 : has_min][R - 1];
}

int ae_quant_gemm(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                  int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                  int num_threads) {
    if (fmt < 0 || fmt >= AE_QUANT_FORMATS) return -3;
    const struct fmt_info fi = FMT[fmt];
    const int r8 = fmt >= AE_QUANT_Q4_K_R8;
    if (r8 && N % 8) return -2;
    if (K <= 0 || K % fi.values) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t nb = K / fi.values, nb32 = K / 32, S = K / fi.sub, row_bytes = nb * fi.bytes;
    /* x: int8 values, block scales, and per sub-block -o * A_s and da * A_s */
    const size_t q_bytes = (size_t)(M * K), d_bytes = (size_t)(M * nb32) * 4;
    const size_t s_bytes = (size_t)(M * S) * 4;
    char *xbuf = malloc(q_bytes + d_bytes + 2 * s_bytes);
    if (xbuf == NULL) return -1;
    int8_t *qa = (int8_t *)xbuf;
    float *da = (float *)(xbuf + q_bytes);
    int32_t *init = (int32_t *)(xbuf + q_bytes + d_bytes);
    float *fa = (float *)(xbuf + q_bytes + d_bytes + s_bytes);
    /* the K-quants' activations as quant_kquants.c's: one scale per 256 values */
    if (fi.values == 256) ae_quantize_rows_q8k(dt, x, x_st, M, K, qa, da, num_threads);
    else ae_quantize_rows_q8(dt, x, x_st, M, K, qa, da, num_threads);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t s = 0; s < S; s++) {
            const int8_t *a = qa + m * K + s * fi.sub;
            int32_t sum = 0;
            for (int j = 0; j < fi.sub; j++) sum += a[j];
            init[m * S + s] = -fi.offset * sum;
            fa[m * S + s] = da[m * nb32 + s * fi.sub / 32] * (float)sum;
        }
    }
    const struct rows xr = {qa, da, init, fi.has_min ? fa : NULL, K, S};
    const int64_t panels = (N + PANEL - 1) / PANEL, kc_max = K < KC ? K : KC;
    const int64_t m_pad = (M + TILE_R - 1) / TILE_R * TILE_R;
    int failed = 0;
    const int threads = panels < num_threads ? (int)panels : num_threads;
#pragma omp parallel num_threads(threads)
    {
        /* u: a chunk of the panel's rows unpacked; the chunk in the panel's layout; its d_s
         * and m_s; the sums of every row of x for the panel */
        const size_t u_bytes = (size_t)(PANEL * kc_max), p_bytes = (size_t)(kc_max / 4 * GROUP);
        const size_t f_bytes = (size_t)(kc_max / fi.sub * PANEL) * 4;
        char *buf = aligned_alloc(64, u_bytes + p_bytes + 2 * f_bytes + (size_t)m_pad * PANEL * 4);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        uint8_t *u = (uint8_t *)buf, *panel = (uint8_t *)buf + u_bytes;
        float *sc = (float *)(buf + u_bytes + p_bytes), *mn = sc + kc_max / fi.sub * PANEL;
        float *res = mn + kc_max / fi.sub * PANEL;
        float bias_row[PANEL];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (buf == NULL) continue;
            const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC, subs = kc / fi.sub;
                for (int c = 0; c < PANEL; c++) {
                    if (c < cols && r8) { /* a group of 8 rows */
                        if (c % 8 == 0 && fmt == AE_QUANT_Q4_K_R8)
                            unpack_group_r8(w, (n0 + c) / 8, nb, k0 / 256, kc / 256, u + c * kc,
                                            kc, sc, mn, c);
                        else if (c % 8 == 0 && fmt == AE_QUANT_Q8_0_R8)
                            unpack_group_q8r8(w, (n0 + c) / 8, nb, k0 / 32, kc / 32, u + c * kc,
                                              kc, sc, c);
                        else if (c % 8 == 0 && fmt == AE_QUANT_Q6_K_R8)
                            unpack_group_q6kr8(w, (n0 + c) / 8, nb, k0 / 256, kc / 256,
                                               u + c * kc, kc, sc, c);
                        else if (c % 8 == 0)
                            unpack_group_q50r8(w, (n0 + c) / 8, nb, k0 / 32, kc / 32,
                                               u + c * kc, kc, sc, c,
                                               fmt == AE_QUANT_Q5_0_R8);
                    } else if (c < cols) {
                        const uint8_t *row = (const uint8_t *)w + (n0 + c) * row_bytes;
                        unpack_row(fmt, row + k0 / fi.values * fi.bytes, kc / fi.values,
                                   u + c * kc, sc, mn, c);
                    } else { /* past N: zero weights, zero scales */
                        memset(u + c * kc, 0, (size_t)kc);
                        for (int64_t t = 0; t < subs; t++) sc[t * PANEL + c] = mn[t * PANEL + c] = 0;
                    }
                }
                for (int half = 0; half < 2; half++)
                    for (int64_t k = 0; k < kc; k += 16)
                        transpose_16(u + half * 16 * kc + k, kc, panel + k / 4 * GROUP + 64 * half);
                for (int64_t m = 0; m < M; m += TILE_R) {
                    const int R = M - m < TILE_R ? (int)(M - m) : TILE_R;
                    tile_for(R, fi.sub, fi.has_min, fi.values == 256)(
                        panel, sc, mn, &xr, m, k0, kc, k0 == 0, res + m * PANEL);
                }
            }
            ae_store_rows(res, PANEL, M, cols, bias, bias_row, dt, out, o_st, n0);
        }
        free(buf);
    }
    free(xbuf);
    return failed ? -1 : 0;
}

#else /* no AVX512-VNNI: quant_legacy.c's and quant_kquants.c's kernels take every product */

int ae_quant_gemm(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                  int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                  int num_threads) {
    (void)fmt, (void)dt, (void)x, (void)x_st, (void)M, (void)w, (void)N, (void)K, (void)bias;
    (void)out, (void)o_st, (void)num_threads;
    return -3;
}

#endif
