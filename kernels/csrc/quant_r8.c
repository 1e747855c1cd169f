/*
 * Q4_K weights with every 8 rows interleaved (format 8, Q4_K_R8): the layout a one-row product
 * on AVX512-VNNI reads fastest, made at load from a GGUF file's Q4_K rows (ae_repack_r8) and
 * nowhere else; Q8_0, Q5_0 and Q4_0 have theirs (below). The same bytes as Q4_K, arranged
 * so that 8 weight rows are one vector's lanes: the scales of 8 rows decode in a few vector
 * instructions instead of scalar code per row, every activation vector is read once for 8
 * rows, and the sub-block scale is one vpdpwssd per 8 rows instead of a permute and a
 * vpdpwssd per row.
 *
 * Measured (AMD Zen 4, one thread, 2048 x 2048 from cache, benchmarks/quant_compute.py,
 * 2026-11-28): 0.85-0.95 ns per 64 values against 1.52 for quant_kquants.c's one-row tile
 * over the Q4_K bytes.
 *
 * A group block: rows 8g..8g+7's super-block b, Q4K_R8_BYTES = 8 x 144 bytes at
 * w + (g * nsb + b) * 1152 (nsb = K / 256), so that N rows take N x K / 256 x 144 bytes and
 * whole groups of rows slice as rows:
 *   [0, 16)     d[8], fp16: row r's at 2r;  [16, 32) dmin[8], fp16
 *   [32, 96)    A[64]: A[8j + r] = sc[r][j] | (m[r][j] >> 4) << 6   (j the sub-block)
 *   [96, 128)   B[32]: B[i] = (m[.] & 15 of element i) | (m[.] & 15 of element i + 32) << 4,
 *               element e = 8j + r
 *   [128, 1152) 16 chunks of 64 bytes: chunk c holds steps 2c (low nibbles) and 2c + 1 (high);
 *               step t is values 8t..8t+7 of each row (in sub-block t / 4). Byte 4L + e of a
 *               chunk, lane L = 2r + h (r < 8, h < 2, e < 4): value 8t + 4h + e of row r, so
 *               that 64-bit lane r of a chunk's nibbles is row r's 8 values of a step.
 * (sc, m: the 6-bit scales and mins get_scale_min_k4 reads; d, dmin as in the Q4_K block.)
 *
 * The VNNI tile. x's rows are quantized per 256 values (ae_quantize_rows_q8k, as for Q4_K).
 * Per chunk, one vpdpbusd of the unsigned nibbles by step t's 8 activation bytes broadcast to
 * every 64-bit lane adds 4 products into each of 16 int32 lanes (row r, half h); a sub-block's
 * 4 steps sum in two such vectors, whose sum (an int16: at most 16 x 15 x 127) one vpdpwssd
 * by the rows' sc (each twice, in the low int16 of its lane) adds into the super-block's
 * integer sum (a vpmulld and an add before: one thread, 2048 x 2048 from cache, 1.00 to 0.93
 * ns per 64 values at one row, 0.70 to 0.62 a row at two, 2026-11-29). Per super-block one
 * conversion and one FMA by d * da; the min terms sum(m_j * bs_j) of the 8 rows in two
 * vpmaddwd over m in int16 pairs (sub-blocks 2jp, 2jp + 1) against bs, the sub-block sums of
 * a, in matching pairs. Every integer sum is exact:
 * the numbers differ from the Q4_K tile's by the order of the fp32 sums only. No software
 * prefetch at one row: with 8 rows' bytes in one stream the hardware's keeps up (a prefetch 4
 * or 8 KB ahead was 2-4% slower on the layers of a 1B model's Q4_K_M file, Zen 4, 2 threads);
 * tiles of several rows prefetch (r8_prefetch).
 *
 * Q8_0_R8 (format 9), the same for Q8_0: rows 8g..8g+7's block b (32 values) is one group
 * block of Q8R8_BYTES = 8 x 34 bytes at w + (g * nb + b) * 272 (nb = K / 32):
 *   [0, 16)    d[8], fp16: row r's at 2r
 *   [16, 272)  4 chunks of 64 bytes: chunk s is step s (values 8s..8s+7 of each row); byte
 *              4L + e, lane L = 2r + h: q of value 8s + 4h + e of row r, plus 128 (q ^ 0x80),
 *              so that vpdpbusd takes it as its unsigned operand (the panel GEMM's u too).
 * Per block and row of x: four vpdpbusd from -128 * sum(a) (the offset's share), one
 * conversion and one FMA by d * da for 8 rows.
 *
 * Q5_0_R8 (format 10) and Q4_0_R8 (11), the same for Q5_0 and Q4_0: one group block of 8 x 22
 * (Q50R8_BYTES, 176) or 8 x 18 bytes (Q40R8_BYTES, 144) per block of 32 values:
 *   [0, 16)    d[8], fp16
 *   [16, 144)  2 chunks of 64 bytes: chunk c holds steps 2c (low nibbles) and 2c + 1 (high),
 *              in Q8_0_R8's lane layout: the low 4 bits of u = q + 16 (Q5_0; Q4_0: q + 8)
 *   [144, 176) Q5_0_R8 only: step s's fifth bits, a little-endian 64-bit mask at 144 + 8s whose
 *              bit i is the step's byte i.
 * The tile is Q8_0_R8's over the nibbles (plus 16 under the mask), from -16 (-8) * sum(a).
 * Measured (as above): Q5_0 2.77 -> 1.07 ns per 64 values, Q4_0 1.92 -> 0.85.
 *
 * Elsewhere (the AVX2 and scalar paths, or a build without AVX512-VNNI): the rows go back to
 * the file's format (ae_unpack_r8) into a buffer and the file's kernels multiply: correct, slower,
 * for a path chosen after the weights were repacked (tests). Many-row products on the VNNI
 * path run on quant_gemm.c's panels, which read the group blocks directly.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HAVE_R8 1
#endif

#include "ae_kernels.h"
#include "ae_vec.h"
#include "kquant_blocks.h"
#include "linear.h"
#include "pool.h"

#define QKK 256
#define SB_BYTES 144
#define Q8_BYTES 34 /* a Q8_0 block */
#define Q6K_BYTES 210 /* a Q6_K super-block */
#define GROUPS_PER_ITEM 2 /* 16 weight rows an item (or more: see linear_r8_vnni) */
#define MAX_R 4           /* rows of x per tile */
/* Tiles of several rows prefetch the weights this far ahead (into L2; see r8_prefetch) */
#define R8_PREFETCH 8192
#define PATH_VNNI 2       /* quant_legacy.c's path code */

/* ---- the layout, both ways ---- */

static void repack_group(const uint8_t *src, int64_t row_bytes, int64_t b, uint8_t *o) {
    uint8_t sc[8][8], mn[8][8], q[8][QKK];
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = src + r * row_bytes + b * SB_BYTES;
        memcpy(o + 2 * r, blk, 2);
        memcpy(o + 16 + 2 * r, blk + 2, 2);
        k4_scales(blk + 4, sc[r], mn[r]);
        unpack_sb(FMT_Q4_K, blk, q[r]);
    }
    for (int e = 0; e < 64; e++) {
        const int j = e / 8, r = e % 8;
        o[32 + e] = (uint8_t)(sc[r][j] | ((mn[r][j] >> 4) << 6));
    }
    for (int i = 0; i < 32; i++) {
        const int e1 = i + 32;
        o[96 + i] = (uint8_t)((mn[i % 8][i / 8] & 15) | ((mn[e1 % 8][e1 / 8] & 15) << 4));
    }
    for (int c = 0; c < 16; c++)
        for (int L = 0; L < 16; L++)
            for (int e = 0; e < 4; e++) {
                const int r = L / 2, v = 16 * c + 4 * (L % 2) + e;
                o[128 + 64 * c + 4 * L + e] = (uint8_t)(q[r][v] | (q[r][v + 8] << 4));
            }
}

static void repack_q8_group(const uint8_t *src, int64_t row_bytes, int64_t b, uint8_t *o) {
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = src + r * row_bytes + b * Q8_BYTES;
        memcpy(o + 2 * r, blk, 2);
        for (int v = 0; v < 32; v++)
            o[16 + 64 * (v / 8) + r8_lane_byte(v, r)] = (uint8_t)(blk[2 + v] ^ 0x80);
    }
}

/* Q5_0 (hb 1) or Q4_0 (hb 0) rows' block b into a Q5_0_R8 / Q4_0_R8 group block */
static void repack_q50_group(const uint8_t *src, int64_t row_bytes, int64_t b, int hb,
                             uint8_t *o) {
    memset(o + 16, 0, hb ? Q50R8_BYTES - 16 : Q40R8_BYTES - 16);
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = src + r * row_bytes + b * (hb ? 22 : 18), *qs = blk + 2 + 4 * hb;
        uint32_t qh = 0;
        if (hb) memcpy(&qh, blk + 2, 4);
        memcpy(o + 2 * r, blk, 2);
        for (int v = 0; v < 32; v++) {
            const int s = v / 8, p = r8_lane_byte(v, r);
            const int n = v < 16 ? qs[v] & 15 : qs[v - 16] >> 4;
            o[16 + 64 * (s / 2) + p] |= (uint8_t)(n << (4 * (s % 2)));
            if (hb) o[144 + 8 * s + p / 8] |= (uint8_t)(((qh >> v) & 1) << (p % 8));
        }
    }
}

/* Q6_K rows' super-block b into a Q6_K_R8 group block */
static void repack_q6k_group(const uint8_t *src, int64_t row_bytes, int64_t b, uint8_t *o) {
    memset(o + 144, 0, Q6KR8_BYTES - 144);
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = src + r * row_bytes + b * Q6K_BYTES;
        uint8_t u[QKK];
        memcpy(o + 2 * r, blk + 208, 2);
        for (int j = 0; j < 16; j++) o[16 + 8 * j + r] = blk[192 + j];
        unpack_sb(FMT_Q6_K, blk, u);
        for (int v = 0; v < QKK; v++) {
            const int t = v / 8, p = r8_lane_byte(v, r);
            o[q6kr8_low(t / 2) + p] |= (uint8_t)((u[v] & 15) << (4 * (t % 2)));
            o[q6kr8_high(t / 4) + p] |= (uint8_t)((u[v] >> 4) << (2 * (t % 4)));
        }
    }
}

/* Row r of group block g of interleaved format fmt as the file's block it was made from */
static void r8_block(int fmt, const uint8_t *g, int r, uint8_t *blk) {
    switch (fmt) {
    case FMT_Q4_K_R8: q4k_r8_block(g, r, blk); break;
    case FMT_Q8_0_R8: q8r8_block(g, r, blk); break;
    case FMT_Q6_K_R8: q6kr8_block(g, r, blk); break;
    default: q50r8_block(g, r, fmt == FMT_Q5_0_R8, blk); break;
    }
}

/* The file's block bytes and values of fmt's source format, or 0 when fmt is no interleaved
 * format or N, K do not fit it */
static int64_t r8_shape(int fmt, int64_t N, int64_t K, int64_t *values) {
    static const int64_t BLOCK[5][2] = {
        {SB_BYTES, QKK}, {Q8_BYTES, 32}, {22, 32}, {18, 32}, {Q6K_BYTES, QKK}};
    if (r8_source_format(fmt) < 0) return 0;
    const int64_t *bv = BLOCK[fmt - FMT_Q4_K_R8];
    if (N < 0 || N % 8 || K <= 0 || K % bv[1]) return 0;
    *values = bv[1];
    return bv[0];
}

int ae_repack_r8(int fmt, const void *src, void *dst, int64_t N, int64_t K, int num_threads) {
    int64_t values = 0;
    const int64_t bytes = r8_shape(fmt, N, K, &values), gb = r8_group_bytes(fmt);
    if (bytes == 0) return r8_source_format(fmt) < 0 ? -3 : -2;
    const int64_t nb = K / values, row_bytes = nb * bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rows = (const uint8_t *)src + g * 8 * row_bytes;
            uint8_t *o = (uint8_t *)dst + (g * nb + b) * gb;
            if (fmt == FMT_Q4_K_R8) repack_group(rows, row_bytes, b, o);
            else if (fmt == FMT_Q8_0_R8) repack_q8_group(rows, row_bytes, b, o);
            else if (fmt == FMT_Q6_K_R8) repack_q6k_group(rows, row_bytes, b, o);
            else repack_q50_group(rows, row_bytes, b, fmt == FMT_Q5_0_R8, o);
        }
    return 0;
}

int ae_unpack_r8(int fmt, const void *src, void *dst, int64_t N, int64_t K, int num_threads) {
    int64_t values = 0;
    const int64_t bytes = r8_shape(fmt, N, K, &values), gb = r8_group_bytes(fmt);
    if (bytes == 0) return r8_source_format(fmt) < 0 ? -3 : -2;
    const int64_t nb = K / values, row_bytes = nb * bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++)
                r8_block(fmt, (const uint8_t *)src + (g * nb + b) * gb, r,
                         (uint8_t *)dst + (g * 8 + r) * row_bytes + b * bytes);
    return 0;
}

#ifdef HAVE_R8

/* ---- activations ---- */

/* What the tile reads of a row of x (per super-block b): a + 256 b, its int8 values; mv +
 * 64 b, the sub-block sums of a as int16 pairs for the min terms (dword lane L of half z:
 * bs[2jp], bs[2jp + 1] with jp = 2z + L / 8); da[b], its scale. */
struct r8_rows {
    const int8_t *a;
    const int16_t *mv;
    const float *da;
};

static void row_sums(const int8_t *a, const float *da32, int64_t K, int16_t *mv, float *da) {
    for (int64_t b = 0; b < K / QKK; b++) {
        int16_t bs[8];
        for (int j = 0; j < 8; j++) {
            int32_t s = 0; /* |s| <= 32 * 127: an int16 */
            for (int i = 0; i < 32; i++) s += a[b * QKK + 32 * j + i];
            bs[j] = (int16_t)s;
        }
        for (int w = 0; w < 64; w++) {
            const int z = w / 32, L = (w % 32) / 2, jp = 2 * z + L / 8;
            mv[64 * b + w] = bs[2 * jp + w % 2];
        }
        da[b] = da32[8 * b];
    }
}

/* Q6_K_R8's per super-block b: off + 32 b, per sub-block j of 16 values two int32, -32 times
 * the sum of a over its values of each half h (8t + 4h + e, the lanes they meet); da[b]. */
static void row_offsets_q6k(const int8_t *a, const float *da32, int64_t K, int32_t *off,
                            float *da) {
    for (int64_t b = 0; b < K / QKK; b++) {
        for (int j = 0; j < 16; j++) {
            int32_t h[2] = {0, 0};
            for (int k = 0; k < 16; k++) h[(k % 8) / 4] += a[b * QKK + 16 * j + k];
            off[32 * b + 2 * j] = -32 * h[0];
            off[32 * b + 2 * j + 1] = -32 * h[1];
        }
        da[b] = da32[8 * b];
    }
}

/* ---- the tile: R rows of x against one group of 8 weight rows ---- */

/* The block of `bytes` at o + R8_PREFETCH into L2, for tiles of R > 1 rows. One row's tile
 * streams its weights fast enough for the hardware prefetchers; with several rows each
 * row's activations and sums are streams of their own (at K = 8192 and 4 rows they no
 * longer fit L1), the weights arrived late, and from memory the tile ran at 2.2x its time
 * from the cache (Q4_K_R8, 4 rows, one thread). With it, 2 threads from memory: 2-5 rows
 * 0.50-0.83x the panel GEMM's time where they were 0.82-1.45x (Llama-3.2-1B's projections). */
static ALWAYS_INLINE void r8_prefetch(const int R, const uint8_t *o, int64_t bytes) {
    if (R > 1)
        for (int64_t l = 0; l < bytes; l += 64)
            _mm_prefetch((const char *)o + R8_PREFETCH + l, _MM_HINT_T1);
}

/* m's bytes from [j][r] to [jp][r][2]: byte 16jp + 2r + p from 8(2jp + p) + r, which is in
 * the same 128-bit lane (one vpshufb) */
static const uint8_t MPERM[64] __attribute__((aligned(64))) = {
    0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13,
    6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11,
    4, 12, 5, 13, 6, 14, 7, 15};

static ALWAYS_INLINE void tile_r8(const int R, const uint8_t *w, int64_t nsb,
                                  const struct r8_rows *x, float *res, int64_t res_st) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i m63 = _mm512_set1_epi8(63);
    /* B's high nibbles (elements 32-63) to the upper half */
    const __m512i bshift = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004, 0x0004000400040004,
                                             0x0004000400040004, 0x0004000400040004);
    const __m512i mperm = _mm512_loadu_si512(MPERM);
    __m512 acc[MAX_R];
    __m256 accm[MAX_R];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *o = w + b * Q4K_R8_BYTES;
        r8_prefetch(R, o, Q4K_R8_BYTES);
        /* the 8 rows' scales, each byte twice (lanes 2r and 2r + 1 of a sub-block's sums),
         * stored and read back a sub-block at a time; the mins in int16 pairs */
        const __m512i A = _mm512_loadu_si512(o + 32), sc = _mm512_and_si512(A, m63);
        uint8_t scb[128] __attribute__((aligned(64)));
        _mm512_store_si512(scb, _mm512_unpacklo_epi8(sc, sc)); /* sub-blocks 0 2 4 6 */
        _mm512_store_si512(scb + 64, _mm512_unpackhi_epi8(sc, sc)); /* 1 3 5 7 */
        const __m512i mhi = _mm512_and_si512(_mm512_srli_epi16(A, 2), m30);
        const __m512i Bz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(o + 96)));
        const __m512i mlo = _mm512_and_si512(_mm512_srlv_epi16(Bz, bshift), m4);
        const __m512i mj = _mm512_shuffle_epi8(_mm512_or_si512(mhi, mlo), mperm);
        const __m512i m16a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(mj));
        const __m512i m16b = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(mj, 1));
        __m512i isum[MAX_R];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m512i P0 = _mm512_loadu_si512(o + 128 + 128 * j);
            const __m512i P1 = _mm512_loadu_si512(o + 192 + 128 * j);
            const __m512i w0 = _mm512_and_si512(P0, m4);
            const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(P0, 4), m4);
            const __m512i w2 = _mm512_and_si512(P1, m4);
            const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(P1, 4), m4);
            const __m512i scv = _mm512_cvtepu8_epi32(
                _mm_load_si128((const __m128i *)(scb + 64 * (j % 2) + 16 * (j / 2))));
            for (int r = 0; r < R; r++) {
                /* step t's 8 values of a in every 64-bit lane: lane 2r + h meets a[8t + 4h..] */
                const int64_t *a = (const int64_t *)(x[r].a + b * QKK + 32 * j);
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0,
                                                 _mm512_set1_epi64(a[0]));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1,
                                                 _mm512_set1_epi64(a[1]));
                s0 = _mm512_dpbusd_epi32(s0, w2, _mm512_set1_epi64(a[2]));
                s1 = _mm512_dpbusd_epi32(s1, w3, _mm512_set1_epi64(a[3]));
                /* |s0 + s1| <= 16 * 15 * 127: an int16, times the scale in one vpdpwssd */
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_add_epi32(s0, s1), scv);
            }
        }
        /* d of row r in lanes 2r and 2r + 1 */
        const __m128i d8 = _mm_loadu_si128((const __m128i *)o);
        const __m512 d16 = _mm512_cvtph_ps(
            _mm256_set_m128i(_mm_unpackhi_epi16(d8, d8), _mm_unpacklo_epi16(d8, d8)));
        const __m256 dmv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)));
        for (int r = 0; r < R; r++) {
            const float da = x[r].da[b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                     _mm512_mul_ps(d16, _mm512_set1_ps(da)), acc[r]);
            const int16_t *mv = x[r].mv + 64 * b;
            const __m512i ms =
                _mm512_add_epi32(_mm512_madd_epi16(m16a, _mm512_loadu_si512(mv)),
                                 _mm512_madd_epi16(m16b, _mm512_loadu_si512(mv + 32)));
            const __m256i ms8 = _mm256_add_epi32(_mm512_castsi512_si256(ms),
                                                 _mm512_extracti64x4_epi64(ms, 1));
            accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms8),
                                      _mm256_mul_ps(dmv, _mm256_set1_ps(da)), accm[r]);
        }
    }
    /* row r's sum: lanes 2r and 2r + 1, less its min terms */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; r++) {
        const __m512 pairs = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));
        const __m256 s = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, pairs));
        _mm256_storeu_ps(res + r * res_st, _mm256_sub_ps(s, accm[r]));
    }
}

/* Row r of x's 8 sums, lanes 2r and 2r + 1 of acc[r] added, to res + r * res_st. */
static ALWAYS_INLINE void store_pairs(const int R, const __m512 *acc, float *res,
                                      int64_t res_st) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; r++) {
        const __m512 pairs = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));
        _mm256_storeu_ps(res + r * res_st,
                         _mm512_castps512_ps256(_mm512_permutexvar_ps(even, pairs)));
    }
}

static ALWAYS_INLINE __mmask64 mask_at(const uint8_t *p) {
    uint64_t m;
    memcpy(&m, p, 8);
    return _cvtu64_mask64(m);
}

/* Q8_0_R8, Q5_0_R8, Q4_0_R8 (fmt, a constant where inlined): R rows of x (a: int8 values; da:
 * one scale per block; mv: per block two int32, -o times the sum of a over the values of each
 * half h, the values 8s + 4h + e, for the format's offset o: 128, 16, 8) against one group of
 * 8 weight rows of nb blocks. The steps' unsigned values: Q8_0_R8's bytes as they are, Q5_0_R8
 * and Q4_0_R8's nibbles (Q5_0_R8's plus 16 where a mask bit is set). */
static ALWAYS_INLINE void tile_r8_32(const int R, const int fmt, const uint8_t *w, int64_t nb,
                                     const struct r8_rows *x, float *res, int64_t res_st) {
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i m4 = _mm512_set1_epi8(15), h16 = _mm512_set1_epi8(16);
    const int64_t gb = r8_group_bytes(fmt);
    __m512 acc[MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = w + b * gb;
        r8_prefetch(R, o, gb);
        /* d of row r in lanes 2r and 2r + 1 */
        const __m512 d16 = _mm512_permutexvar_ps(
            dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o))));
        __m512i c0, c1, c2, c3;
        if (fmt == FMT_Q8_0_R8) {
            c0 = _mm512_loadu_si512(o + 16), c1 = _mm512_loadu_si512(o + 80);
            c2 = _mm512_loadu_si512(o + 144), c3 = _mm512_loadu_si512(o + 208);
        } else {
            const __m512i lo = _mm512_loadu_si512(o + 16), hi = _mm512_loadu_si512(o + 80);
            c0 = _mm512_and_si512(lo, m4), c1 = _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4);
            c2 = _mm512_and_si512(hi, m4), c3 = _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4);
            if (fmt == FMT_Q5_0_R8) {
                c0 = _mm512_mask_add_epi8(c0, mask_at(o + 144), c0, h16);
                c1 = _mm512_mask_add_epi8(c1, mask_at(o + 152), c1, h16);
                c2 = _mm512_mask_add_epi8(c2, mask_at(o + 160), c2, h16);
                c3 = _mm512_mask_add_epi8(c3, mask_at(o + 168), c3, h16);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t *a = (const int64_t *)(x[r].a + 32 * b);
            const int32_t *off = (const int32_t *)x[r].mv;
            /* lanes 2r, 2r + 1 start from the offset's share of their halves' values */
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_set1_epi64(*(const int64_t *)(off + 2 * b)),
                                             c0, _mm512_set1_epi64(a[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1,
                                             _mm512_set1_epi64(a[1]));
            s0 = _mm512_dpbusd_epi32(s0, c2, _mm512_set1_epi64(a[2]));
            s1 = _mm512_dpbusd_epi32(s1, c3, _mm512_set1_epi64(a[3]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                     _mm512_mul_ps(d16, _mm512_set1_ps(x[r].da[b])), acc[r]);
        }
    }
    store_pairs(R, acc, res, res_st);
}

/* ---- the product, item by item ---- */

struct r8_job {
    const uint8_t *w;
    const int8_t *a;
    const int16_t *mv;
    const float *da;
    const void *bias;
    void *out;
    int64_t M, N, K, o_st, per_item; /* groups an item */
    int dt, fmt;
};

/* Q6_K_R8: R rows of x (a: int8 values, da: a scale per super-block, mv: row_offsets_q6k's)
 * against one group of 8 weight rows of nsb super-blocks. Per sub-block j (16 values: steps
 * 2j and 2j + 1, low chunk j, half of high chunk j / 2) two vpdpbusd
 * from the offset's share (their sum of 8 (u - 32) a is at most 8 x 32 x 127: an int16), one
 * vpdpwssd by the 8 rows' scales (each twice, in the low int16 of the lane) into int32 for
 * the super-block: |sum| <= 16 x 64 x 127 x 128 x 16, an int32. (A vpmulld and an add
 * before: 1.57 to 1.42 ns per 64 values at one row, 1.01 to 0.85 a row at two, measured as
 * Q4_K_R8's.) */
static ALWAYS_INLINE void tile_q6kr8(const int R, const uint8_t *w, int64_t nsb,
                                     const struct r8_rows *x, float *res, int64_t res_st) {
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *o = w + b * Q6KR8_BYTES;
        r8_prefetch(R, o, Q6KR8_BYTES);
        const __m512 d16 = _mm512_permutexvar_ps(
            dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o))));
        __m512i isum[MAX_R];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const __m512i q = _mm512_loadu_si512(o + q6kr8_low(j));
            const __m512i hb = _mm512_loadu_si512(o + q6kr8_high(j / 2));
            /* steps 2j, 2j + 1: bits 2i..2i + 1 and 2i + 2..2i + 3 of the high chunk (i =
             * 2 (j % 2)) to bits 4..5; what a 16-bit shift brings from the other byte is
             * masked off */
            const __m512i h0 = j % 2 ? hb : _mm512_slli_epi16(hb, 4);
            const __m512i h1 = j % 2 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
            const __m512i u0 = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(h0, m30));
            const __m512i u1 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(q, 4), m4), _mm512_and_si512(h1, m30));
            const __m128i s8 = _mm_loadl_epi64((const __m128i *)(o + 16 + 8 * j));
            /* the scales in the low int16 of each lane, the high one 0, for vpdpwssd */
            const __m512i scv =
                _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8)));
            for (int r = 0; r < R; r++) {
                const int64_t *a = (const int64_t *)(x[r].a + b * QKK + 16 * j);
                const int64_t *off = (const int64_t *)x[r].mv + 16 * b + j;
                __m512i s = _mm512_dpbusd_epi32(_mm512_set1_epi64(*off), u0,
                                                _mm512_set1_epi64(a[0]));
                s = _mm512_dpbusd_epi32(s, u1, _mm512_set1_epi64(a[1]));
                /* s = the sum of 8 (u - 32) a: at most 8 * 32 * 127, an int16 */
                isum[r] = _mm512_dpwssd_epi32(isum[r], s, scv);
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                     _mm512_mul_ps(d16, _mm512_set1_ps(x[r].da[b])), acc[r]);
    }
    store_pairs(R, acc, res, res_st);
}

/* The tile of fmt, R rows of x (one inlined copy per format and R) */
static ALWAYS_INLINE void tile_for(const int R, const int fmt, const uint8_t *w, int64_t nblk,
                                   const struct r8_rows *x, float *res, int64_t res_st) {
    switch (fmt) {
    case FMT_Q4_K_R8: tile_r8(R, w, nblk, x, res, res_st); break;
    case FMT_Q8_0_R8: tile_r8_32(R, FMT_Q8_0_R8, w, nblk, x, res, res_st); break;
    case FMT_Q5_0_R8: tile_r8_32(R, FMT_Q5_0_R8, w, nblk, x, res, res_st); break;
    case FMT_Q6_K_R8: tile_q6kr8(R, w, nblk, x, res, res_st); break;
    default: tile_r8_32(R, FMT_Q4_0_R8, w, nblk, x, res, res_st); break;
    }
}

static void r8_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct r8_job *j = ctx;
    const int kq = j->fmt == FMT_Q4_K_R8 || j->fmt == FMT_Q6_K_R8; /* super-blocks of 256 */
    /* blocks a row, their int16 / int32 sums of a a row (mv), group block bytes */
    const int64_t nblk = kq ? j->K / QKK : j->K / 32, mv_row = kq ? 64 * nblk : 4 * nblk;
    const int64_t gb = r8_group_bytes(j->fmt);
    const int64_t g0 = item * j->per_item;
    const int64_t g1 = g0 + j->per_item < j->N / 8 ? g0 + j->per_item : j->N / 8;
    const int64_t n0 = 8 * g0, cols = 8 * (g1 - g0);
    float *res = ae_thread_scratch((size_t)(j->M * cols + cols));
    for (int64_t m = 0; m < j->M; m += MAX_R) {
        const int R = j->M - m < MAX_R ? (int)(j->M - m) : MAX_R;
        struct r8_rows x[MAX_R];
        for (int r = 0; r < R; r++)
            x[r] = (struct r8_rows){j->a + (m + r) * j->K, j->mv + (m + r) * mv_row,
                                    j->da + (m + r) * nblk};
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *w = j->w + g * nblk * gb;
            float *rg = res + m * cols + 8 * (g - g0);
            switch (R) {
            case 1: tile_for(1, j->fmt, w, nblk, x, rg, cols); break;
            case 2: tile_for(2, j->fmt, w, nblk, x, rg, cols); break;
            case 3: tile_for(3, j->fmt, w, nblk, x, rg, cols); break;
            default: tile_for(4, j->fmt, w, nblk, x, rg, cols); break;
            }
        }
    }
    ae_commit_rows(commit, res, j->M, cols, j->bias, j->dt, j->out, j->o_st, n0);
}

static int linear_r8_vnni(int fmt, int dt, const void *x, int64_t x_st, int64_t M,
                          const void *w, int64_t N, int64_t K, const void *bias, void *out,
                          int64_t o_st, int num_threads) {
    const int q8 = fmt != FMT_Q4_K_R8 && fmt != FMT_Q6_K_R8; /* blocks of 32: Q8_0, Q5_0, Q4_0 */
    const int64_t nsb = K / QKK, nb = K / 32;
    /* x's rows where the item's threads read them: the pool's buffer when the caller holds
     * the pool (a late helper may read it after this call), else fresh memory. Floats first,
     * then the sums (Q4_K: int16 pairs, Q6_K: int32 pairs, 128 bytes a super-block; blocks
     * of 32: two int32 a
     * block), then the bytes (each part a multiple of 64 bytes). */
    const size_t d_bytes = (size_t)(M * nb) * 4 + (size_t)(M * nsb) * 4;
    const size_t mv_bytes = (size_t)(M * (q8 ? nb * 8 : nsb * 128)), q_bytes = (size_t)(M * K);
    const size_t head = (d_bytes + 63) / 64 * 64, mv_pad = (mv_bytes + 63) / 64 * 64;
    const size_t bytes = head + mv_pad + q_bytes;
    const int pooled = ae_linear_use_pool(M, num_threads);
    char *buf = pooled ? ae_pool_buffer(0, bytes) : aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (buf == NULL) {
        if (pooled) ae_pool_release();
        return -1;
    }
    float *da32 = (float *)buf, *da = q8 ? da32 : da32 + M * nb;
    int16_t *mv = (int16_t *)(buf + head);
    int8_t *qa = (int8_t *)(buf + head + mv_pad);
    if (q8) {
        ae_quantize_rows_q8(dt, x, x_st, M, K, qa, da32, pooled ? 1 : num_threads);
        /* the offset's share of each half's sums (see tile_r8_32) */
        const int o = fmt == FMT_Q8_0_R8 ? 128 : fmt == FMT_Q5_0_R8 ? 16 : 8;
        int32_t *off = (int32_t *)mv;
        for (int64_t i = 0; i < M * nb; i++) {
            int32_t s[2] = {0, 0};
            for (int v = 0; v < 32; v++) s[(v % 8) / 4] += qa[32 * i + v];
            off[2 * i] = -o * s[0];
            off[2 * i + 1] = -o * s[1];
        }
    } else {
        ae_quantize_rows_q8k(dt, x, x_st, M, K, qa, da32, pooled ? 1 : num_threads);
        for (int64_t m = 0; m < M; m++) {
            if (fmt == FMT_Q6_K_R8)
                row_offsets_q6k(qa + m * K, da32 + m * nb, K, (int32_t *)(mv + m * nsb * 64),
                                da + m * nsb);
            else row_sums(qa + m * K, da32 + m * nb, K, mv + m * nsb * 64, da + m * nsb);
        }
    }
    int64_t per_item = GROUPS_PER_ITEM;
    while ((N / 8 + per_item - 1) / per_item > AE_POOL_MAX_ITEMS) per_item += GROUPS_PER_ITEM;
    const struct r8_job job = {w, qa, mv, da, bias, out, M, N, K, o_st, per_item, dt, fmt};
    const int64_t items = (N / 8 + per_item - 1) / per_item;
    ae_linear_run_items(pooled, r8_item, &job, sizeof job, items, num_threads);
    if (pooled) ae_pool_release();
    else free(buf);
    return 0;
}

#endif /* HAVE_R8 */

int ae_linear_r8(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                 int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                 int num_threads) {
    int64_t values = 0;
    const int64_t bytes = r8_shape(fmt, N, K, &values);
    if (bytes == 0) return r8_source_format(fmt) < 0 ? -3 : -2;
    if (M <= 0 || N == 0) return 0;
#ifdef HAVE_R8
    if (ae_quant_set_path(-2) == PATH_VNNI)
        return linear_r8_vnni(fmt, dt, x, x_st, M, w, N, K, bias, out, o_st, num_threads);
#endif
    /* another path: the rows back in the file's format, multiplied there */
    void *rows = malloc((size_t)(N * (K / values) * bytes));
    if (rows == NULL) return -1;
    ae_unpack_r8(fmt, w, rows, N, K, num_threads);
    const int r = ae_linear_quant(r8_source_format(fmt), dt, x, x_st, M, rows, N, K, bias, out,
                                  o_st, num_threads);
    free(rows);
    return r;
}
