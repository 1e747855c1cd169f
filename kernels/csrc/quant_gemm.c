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
 * Work: panels of 32 weight rows, one item each: on the work pool (pool.c) for up to
 * AE_POOL_MAX_ROWS rows of x, as the decode step's other products, else split between OpenMP
 * threads a contiguous range each. A thread unpacks its panel's rows into bytes (plain loops
 * GCC vectorizes), transposes them 16 rows by 4 values at a time into the panel (32 x K
 * bytes, in L2), then runs every 4 rows of x over it, the sums in its own scratch until the
 * item is committed. The 8-row layouts (quant_r8.c) go into the panel without the row-major
 * bytes: two groups' steps make its groups in one permute each (r8_pair). While the rows run
 * over a chunk, the tiles prefetch the next chunk's weights (struct gemm_pf): the unpacking no
 * longer waits on memory with no product running.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "kquant_blocks.h"
#include "linear.h"
#include "quant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_GEMM 1
#endif
#define PANEL GEMM_PANEL
#define KC GEMM_KC
#define FMT GEMM_FMT

#ifdef HAVE_GEMM

#define TILE_R 4  /* rows of x per tile */
#define GROUP 128 /* bytes of a panel per 4 values: PANEL x 4 */

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
    case AE_QUANT_Q5_0_BYTES: /* d, qs[32]: q - 16 */
        sc[0] = f16_at(b);
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)(b[2 + j] + 16);
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
        if (fmt == 5) {
            unpack_sb(fmt, b, u);
            break;
        }
        /* Q5_K in vectors (unpack_sb's byte shifts of qh by 2c did not vectorize): values
         * 64c .. 64c + 31 are qs[32c + l]'s low nibbles, 64c + 32 .. its high ones, plus 16
         * where bit 2c (2c + 1) of qh[l] is set */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i m4 = _mm256_set1_epi8(15);
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1);
            const __mmask64 h =
                (__mmask64)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c)))) |
                (__mmask64)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c + 1))))
                    << 32;
            _mm512_storeu_si512(u + 64 * c,
                                _mm512_mask_add_epi8(v, h, v, _mm512_set1_epi8(16)));
        }
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

GEMM_UNPACK_ROWS

/* The 8-row layouts (quant_r8.c) hold a group of 8 weight rows' values in steps of 64 bytes,
 * 64-bit lane r of a step being row r's 8 consecutive values. r8_steps gives the 4 steps of
 * group g's 32-value unit `unit` (counted from the row's start) as u, the values the row
 * unpackers give (q + o): Q8_0_R8 stores them so; Q4_0_R8 and Q5_0_R8 hold steps 2c and
 * 2c + 1 in chunk c's low and high nibbles, Q5_0's fifth bits as a 64-bit mask per step
 * (bit p for byte p); Q4_K_R8's chunk c holds values 16c .. 16c + 15 of a super-block the
 * same way; Q6_K_R8's part p holds steps 4p .. 4p + 3, their low 4 bits in its two low
 * chunks (the even step in the low nibbles), their high 2 bits at bits 2 (t % 4) of its high
 * chunk (kquant_blocks.h). nb: the group's blocks (super-blocks) per row. */
static ALWAYS_INLINE void r8_steps(const int fmt, const uint8_t *restrict w, int64_t g, int64_t nb,
                                   int64_t unit, __m512i v[4]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    switch (fmt) {
    case AE_QUANT_Q8_0_R8: {
        const uint8_t *blk = w + (g * nb + unit) * Q8R8_BYTES + 16;
        for (int t = 0; t < 4; t++) v[t] = _mm512_loadu_si512(blk + 64 * t);
        break;
    }
    case AE_QUANT_Q5_0_R8:
    case AE_QUANT_Q4_0_R8: {
        const int hb = fmt == AE_QUANT_Q5_0_R8;
        const uint8_t *blk = w + (g * nb + unit) * r8_group_bytes(fmt);
        for (int c = 0; c < 2; c++) {
            const __m512i P = _mm512_loadu_si512(blk + 16 + 64 * c);
            v[2 * c] = _mm512_and_si512(P, m4);
            v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
        }
        if (hb) {
            const __m512i b4 = _mm512_set1_epi8(16);
            for (int s = 0; s < 4; s++) {
                uint64_t bits;
                memcpy(&bits, blk + 144 + 8 * s, 8);
                v[s] = _mm512_or_si512(v[s], _mm512_maskz_mov_epi8((__mmask64)bits, b4));
            }
        }
        break;
    }
    case AE_QUANT_Q4_K_R8: {
        const uint8_t *blk = w + (g * nb + unit / 8) * Q4K_R8_BYTES + 128 + 128 * (unit % 8);
        for (int c = 0; c < 2; c++) {
            const __m512i P = _mm512_loadu_si512(blk + 64 * c);
            v[2 * c] = _mm512_and_si512(P, m4);
            v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
        }
        break;
    }
    default: { /* Q6_K_R8 */
        const uint8_t *blk = w + (g * nb + unit / 8) * Q6KR8_BYTES;
        const int p = (int)(unit % 8);
        const __m512i m3 = _mm512_set1_epi8(3 << 4);
        const __m512i L0 = _mm512_loadu_si512(blk + q6kr8_low(2 * p));
        const __m512i L1 = _mm512_loadu_si512(blk + q6kr8_low(2 * p + 1));
        const __m512i H = _mm512_loadu_si512(blk + q6kr8_high(p));
        /* the high bits of step 4p + k, moved to bits 4-5 */
        v[0] = _mm512_or_si512(_mm512_and_si512(L0, m4),
                               _mm512_and_si512(_mm512_slli_epi16(H, 4), m3));
        v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), m4),
                               _mm512_and_si512(_mm512_slli_epi16(H, 2), m3));
        v[2] = _mm512_or_si512(_mm512_and_si512(L1, m4), _mm512_and_si512(H, m3));
        v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), m4),
                               _mm512_and_si512(_mm512_srli_epi16(H, 2), m3));
        break;
    }
    }
}

/* Units u0 .. u0 + units - 1 of groups ga and gb (-1: none, zero values) straight into 16
 * rows of the panel, ga's as its rows 0-7 and gb's as 8-15 (dst: the panel's first group
 * plus 64 for its second 16 rows). A step's dwords 2r and 2r + 1 are row r's values 0-3 and
 * 4-7 of it, so one vpermt2d of the two groups' steps is a panel group: no row-major copy,
 * no transpose (unpack_row's and transpose_16's way took 3-4x the products' time at 16 rows
 * of x). */
static ALWAYS_INLINE void r8_pair(const int fmt, const uint8_t *restrict w, int64_t ga,
                                  int64_t gb, int64_t nb, int64_t u0, int64_t units,
                                  uint8_t *restrict dst) {
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t i = 0; i < units; i++) {
        __m512i a[4], b[4];
        if (ga >= 0) r8_steps(fmt, w, ga, nb, u0 + i, a);
        else a[0] = a[1] = a[2] = a[3] = _mm512_setzero_si512();
        if (gb >= 0) r8_steps(fmt, w, gb, nb, u0 + i, b);
        else b[0] = b[1] = b[2] = b[3] = _mm512_setzero_si512();
        uint8_t *d = dst + i * 8 * GROUP;
        for (int t = 0; t < 4; t++) {
            _mm512_store_si512((__m512i *)(d + 2 * t * GROUP),
                               _mm512_permutex2var_epi32(a[t], even, b[t]));
            _mm512_store_si512((__m512i *)(d + (2 * t + 1) * GROUP),
                               _mm512_permutex2var_epi32(a[t], odd, b[t]));
        }
    }
}

/* One function per 8-row format, so that r8_steps is compiled for it inside the loop. */
#define R8_PAIR_FN(name, f)                                                                  \
    static void r8_pair_##name(const uint8_t *w, int64_t ga, int64_t gb, int64_t nb,          \
                               int64_t u0, int64_t units, uint8_t *dst) {                     \
        r8_pair(f, w, ga, gb, nb, u0, units, dst);                                            \
    }
R8_PAIR_FN(q4k, AE_QUANT_Q4_K_R8)
R8_PAIR_FN(q80, AE_QUANT_Q8_0_R8)
R8_PAIR_FN(q50, AE_QUANT_Q5_0_R8)
R8_PAIR_FN(q40, AE_QUANT_Q4_0_R8)
R8_PAIR_FN(q6k, AE_QUANT_Q6_K_R8)

static void r8_pair_any(int fmt, const uint8_t *w, int64_t ga, int64_t gb, int64_t nb,
                        int64_t u0, int64_t units, uint8_t *dst) {
    switch (fmt) {
    case AE_QUANT_Q4_K_R8: r8_pair_q4k(w, ga, gb, nb, u0, units, dst); break;
    case AE_QUANT_Q8_0_R8: r8_pair_q80(w, ga, gb, nb, u0, units, dst); break;
    case AE_QUANT_Q5_0_R8: r8_pair_q50(w, ga, gb, nb, u0, units, dst); break;
    case AE_QUANT_Q4_0_R8: r8_pair_q40(w, ga, gb, nb, u0, units, dst); break;
    default: r8_pair_q6k(w, ga, gb, nb, u0, units, dst); break;
    }
}

/* Group g's d_s (and m_s) of its blocks (super-blocks) b0 .. b0 + n - 1 into columns col ..
 * col + 7 of sc and mn, as unpack_row gives them for 8 rows of the file's format. */
static void r8_scales(int fmt, const uint8_t *restrict w, int64_t g, int64_t nb, int64_t b0,
                      int64_t n, float *restrict sc, float *restrict mn, int col) {
    for (int64_t i = 0; i < n; i++) {
        switch (fmt) {
        case AE_QUANT_Q4_K_R8: {
            const uint8_t *blk = w + (g * nb + b0 + i) * Q4K_R8_BYTES;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            /* q4k_r8_scale_min for all 64 (sub-block j, row r) at once, e = 8j + r: the
             * scale a & 63 of byte 32 + e, the min (a >> 6) << 4 | the nibble of byte
             * 96 + e % 32 (the low nibbles for e < 32) */
            const __m512i A = _mm512_loadu_si512(blk + 32);
            const __m256i nb32 = _mm256_loadu_si256((const __m256i *)(blk + 96));
            const __m256i n4 = _mm256_set1_epi8(15);
            const __m512i lo_m = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(nb32, n4)),
                _mm256_and_si256(_mm256_srli_epi16(nb32, 4), n4), 1);
            uint8_t s[64], m[64];
            _mm512_storeu_si512(s, _mm512_and_si512(A, _mm512_set1_epi8(63)));
            _mm512_storeu_si512(
                m, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 2), _mm512_set1_epi8(0x30)),
                                   lo_m));
            for (int j = 0; j < 8; j++) { /* the 8 rows' scale and min of sub-block j */
                const __m256 sv = _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8 * j))));
                const __m256 mv = _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + 8 * j))));
                _mm256_storeu_ps(sc + (i * 8 + j) * PANEL + col, _mm256_mul_ps(d, sv));
                _mm256_storeu_ps(mn + (i * 8 + j) * PANEL + col,
                                 _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mv)));
            }
            break;
        }
        case AE_QUANT_Q6_K_R8: {
            const uint8_t *blk = w + (g * nb + b0 + i) * Q6KR8_BYTES;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            for (int t = 0; t < 16; t++) { /* scale t of the 8 rows: 8 bytes at 16 + 8t */
                const __m128i s8 = _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * t));
                const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
                _mm256_storeu_ps(sc + (i * 16 + t) * PANEL + col, _mm256_mul_ps(d, sv));
            }
            break;
        }
        default: { /* Q8_0_R8, Q5_0_R8, Q4_0_R8: the 8 rows' d first */
            const uint8_t *blk = w + (g * nb + b0 + i) * r8_group_bytes(fmt);
            _mm256_storeu_ps(sc + i * PANEL + col,
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
            break;
        }
        }
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

/* R rows of x (from row m) over the panel's values k0 .. k0 + kc: res[r][0..31] (row stride
 * PANEL) = their fp32 sums, added to what res holds unless `first`. With KQ (the K-quants: one
 * activation scale per 256 values), a super-block's sub-blocks are summed times d_s first and
 * multiplied by da once, at its end: one product fewer per sub-block. */
static ALWAYS_INLINE void tile(const int R, const int SB, const int has_min, const int KQ,
                               const uint8_t *restrict panel, const float *restrict sc,
                               const float *restrict mn, const struct gemm_rows *x, int64_t m,
                               int64_t k0, int64_t kc, int first, float *restrict res,
                               const struct gemm_pf *pf) {
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
    const int64_t steps = kc / SB / per_da;
    const int64_t pf_step = pf ? (pf->to - pf->from + steps - 1) / steps : 0;
    int64_t line = pf ? pf->from : 0;
    for (int64_t sd = 0; sd < kc / SB; sd += per_da) {
        for (int64_t j = 0; j < pf_step && line < pf->to; j++, line++)
            _mm_prefetch((const char *)pf->base[line / pf->per] + 64 * (line % pf->per),
                         _MM_HINT_T1);
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
        const uint8_t *p, const float *sc, const float *mn, const struct gemm_rows *x,      \
        int64_t m, int64_t k0, int64_t kc, int first, float *res,                           \
        const struct gemm_pf *pf) {                                                         \
        tile(R, SB, MIN, KQ, p, sc, mn, x, m, k0, kc, first, res, pf);                      \
    }
#define TILE_FNS(SB, MIN, KQ) TILE_FN(1, SB, MIN, KQ) TILE_FN(2, SB, MIN, KQ) \
    TILE_FN(3, SB, MIN, KQ) TILE_FN(4, SB, MIN, KQ)
TILE_FNS(32, 0, 0)
TILE_FNS(32, 1, 0)
TILE_FNS(32, 1, 1)
TILE_FNS(16, 0, 1)

typedef void (*tile_fn)(const uint8_t *, const float *, const float *, const struct gemm_rows *,
                        int64_t, int64_t, int64_t, int, float *, const struct gemm_pf *);
static tile_fn tile_for(int R, int SB, int has_min, int kq) {
    static const tile_fn fns[4][4] = {
        {tile_1_32_0_0, tile_2_32_0_0, tile_3_32_0_0, tile_4_32_0_0},
        {tile_1_32_1_0, tile_2_32_1_0, tile_3_32_1_0, tile_4_32_1_0},
        {tile_1_32_1_1, tile_2_32_1_1, tile_3_32_1_1, tile_4_32_1_1},
        {tile_1_16_0_1, tile_2_16_0_1, tile_3_16_0_1, tile_4_16_0_1},
    };
    return fns[SB == 16 ? 3 : kq ? 2 : has_min][R - 1];
}

/* Panel p of the product (item p): its chunks unpacked and every row of x run over them,
 * the sums in the thread's scratch (linear.c's, as the other quantized products' items),
 * stored into out if this thread commits the item. */
static void gemm_panel(const void *ctx, int64_t p, const struct ae_commit *commit) {
    const struct gemm_job *j = ctx;
    const int fmt = j->fmt, r8 = AE_QUANT_IS_R8(fmt);
    const struct gemm_fmt fi = FMT[fmt];
    const int64_t M = j->M, N = j->N, K = j->K, nb = j->nb;
    const int64_t kc_max = K < KC ? K : KC, m_pad = (M + TILE_R - 1) / TILE_R * TILE_R;
    /* u: not for the 8-row layouts; the panel: 4 values of its 32 rows per GROUP */
    const struct gemm_scratch b = gemm_scratch(j, r8 ? 0 : (size_t)(PANEL * kc_max),
                                               (size_t)(kc_max / 4 * GROUP), m_pad);
    uint8_t *u = b.u, *panel = b.panel;
    float *sc = b.sc, *mn = b.mn, *res = b.res;
    const uint8_t *w = j->w;
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC, subs = kc / fi.sub;
        if (r8) { /* 16 rows (two groups of 8) at a time, straight into the panel */
            for (int half = 0; half < 2; half++) {
                int64_t gr[2];
                for (int e = 0; e < 2; e++) {
                    const int c = 16 * half + 8 * e;
                    gr[e] = c < cols ? (n0 + c) / 8 : -1;
                    if (c < cols) {
                        r8_scales(fmt, w, gr[e], nb, k0 / fi.values, kc / fi.values, sc, mn, c);
                        continue;
                    }
                    for (int64_t t = 0; t < subs; t++) /* past N: zero scales */
                        for (int i = 0; i < 8; i++) sc[t * PANEL + c + i] = mn[t * PANEL + c + i] = 0;
                }
                r8_pair_any(fmt, w, gr[0], gr[1], nb, k0 / 32, kc / 32, panel + 64 * half);
            }
        } else {
            gemm_unpack_chunk(unpack_row, j, n0, cols, k0, kc, u, sc, mn);
            for (int half = 0; half < 2; half++)
                for (int64_t k = 0; k < kc; k += 16)
                    transpose_16(u + half * 16 * kc + k, kc, panel + k / 4 * GROUP + 64 * half);
        }
        struct gemm_pf pf;
        const int prefetch = j->prefetch && (k0 + KC < K || p + 1 < j->panels);
        if (prefetch) gemm_next_chunk(fmt, w, N, nb, p, k0, K, &pf);
        const int64_t tiles = (M + TILE_R - 1) / TILE_R, lines = prefetch ? pf.to : 0;
        for (int64_t m = 0; m < M; m += TILE_R) {
            const int R = M - m < TILE_R ? (int)(M - m) : TILE_R;
            if (prefetch) { /* each tile its share of the next chunk's lines */
                pf.from = lines * (m / TILE_R) / tiles;
                pf.to = lines * (m / TILE_R + 1) / tiles;
            }
            tile_for(R, fi.sub, fi.has_min, fi.values == 256)(
                panel, sc, mn, &j->xr, m, k0, kc, k0 == 0, res + m * PANEL, prefetch ? &pf : NULL);
        }
    }
    if (!ae_commit_begin(commit)) return; /* another thread committed this panel */
    ae_store_rows(res, PANEL, M, cols, j->bias, b.bias_row, j->dt, j->out, j->o_st, n0);
    ae_commit_end(commit);
}

#endif /* HAVE_GEMM */

#if defined(HAVE_GEMM) || defined(HAVE_GEMM_AVX2)

int ae_quant_gemm(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                  int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                  int num_threads) {
    if (fmt < 0 || fmt >= AE_QUANT_FORMATS) return -3;
    /* the panels of the kernels' path (ae_quant_set_path); AVX2's reads the file layouts */
    const int path = ae_quant_set_path(-2);
    ae_pool_fn panel_fn = NULL;
#ifdef HAVE_GEMM
    if (path == AE_QUANT_PATH_VNNI) panel_fn = gemm_panel;
#endif
#ifdef HAVE_GEMM_AVX2
    if (path == AE_QUANT_PATH_AVX2 && !AE_QUANT_IS_R8(fmt)) panel_fn = ae_gemm_panel_avx2;
#endif
    if (panel_fn == NULL) return -3;
    const struct gemm_fmt fi = FMT[fmt];
    if (AE_QUANT_IS_R8(fmt) && N % 8) return -2;
    if (K <= 0 || K % fi.values) return -2;
    if (M <= 0 || N <= 0) return 0;
#ifdef HAVE_GEMM_AVX2
    /* AVX2's Q8_0 on cores that run it faster in fp32 FMAs (quant_gemm_f32.c) */
    const int f32_rows = ae_quant_gemm_f32_min_rows(fmt);
    if (f32_rows > 0 && M >= f32_rows)
        return ae_quant_gemm_f32(x, dt, x_st, M, w, N, K, bias, out, o_st, num_threads);
#endif
    const int64_t nb32 = K / 32, S = K / fi.sub, panels = (N + PANEL - 1) / PANEL;
    /* AVX2 multiplies Q8_0's signed values as they are (vpsignb), with no offset */
    const int offset = path == AE_QUANT_PATH_AVX2 && fmt == AE_QUANT_Q8_0 ? 0 : fi.offset;
    /* Decode-sized products run on the work pool (pool.h): a helper that is preempted costs
     * its panels, not a wait. x's rows then lie in the pool's buffer (a late helper may read
     * them after this call), else in fresh memory. */
    const int pooled = panels <= AE_POOL_MAX_ITEMS && ae_linear_use_pool(M, num_threads);
    /* x: int8 values, block scales, and per sub-block -o * A_s and da * A_s */
    const size_t q_bytes = (size_t)(M * K), d_bytes = (size_t)(M * nb32) * 4;
    const size_t s_bytes = (size_t)(M * S) * 4, bytes = q_bytes + d_bytes + 2 * s_bytes;
    char *xbuf = pooled ? ae_pool_buffer(0, bytes) : malloc(bytes);
    if (xbuf == NULL) {
        if (pooled) ae_pool_release();
        return -1;
    }
    int8_t *qa = (int8_t *)xbuf;
    float *da = (float *)(xbuf + q_bytes);
    int32_t *init = (int32_t *)(xbuf + q_bytes + d_bytes);
    float *fa = (float *)(xbuf + q_bytes + d_bytes + s_bytes);
    /* the K-quants' activations as quant_kquants.c's: one scale per 256 values */
    const int q_threads = pooled ? 1 : num_threads;
    if (fi.values == 256) ae_quantize_rows_q8k(dt, x, x_st, M, K, qa, da, q_threads);
    else ae_quantize_rows_q8(dt, x, x_st, M, K, qa, da, q_threads);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t s = 0; s < S; s++) {
            const int8_t *a = qa + m * K + s * fi.sub;
            int32_t sum = 0;
            for (int i = 0; i < fi.sub; i++) sum += a[i];
            init[m * S + s] = -offset * sum;
            fa[m * S + s] = da[m * nb32 + s * fi.sub / 32] * (float)sum;
        }
    }
    /* Prefetching pays where the chunk's memory is a large share of its time; past 128 rows
     * of x (their chunk, 128 KB, read from L2 by every tile) it measured level to 4% slower. */
    const struct gemm_job job = {
        w, bias, out, {qa, da, init, fi.has_min ? fa : NULL, K, S}, M, N, K, K / fi.values, o_st,
        panels, fmt, dt, M <= 128,
    };
    ae_linear_run_items(pooled, panel_fn, &job, sizeof job, panels, num_threads);
    if (pooled) ae_pool_release();
    else free(xbuf);
    return 0;
}

#else /* neither AVX512-VNNI nor AVX2: quant_legacy.c's and quant_kquants.c's kernels take
       * every product */

int ae_quant_gemm(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                  int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                  int num_threads) {
    (void)fmt, (void)dt, (void)x, (void)x_st, (void)M, (void)w, (void)N, (void)K, (void)bias;
    (void)out, (void)o_st, (void)num_threads;
    return -3;
}

#endif
