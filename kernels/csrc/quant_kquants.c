/*
 * Linear layers over GGUF's K-quant weights, Q4_K, Q5_K and Q6_K, read as a GGUF file stores
 * them: out = x @ W^T (+ bias), with x's rows quantized to int8 on the way in with one fp32
 * scale per 256 values, one per super-block (ae_quantize_rows_q8k, llama.cpp's block_q8_K: the
 * same activations as quant_gemm.c's K-quant products and as the torch reference). Reached
 * through ae_linear_quant (quant_legacy.c), formats 5, 6 and 7.
 *
 * Weights: W [N][K] is N rows of K / 256 super-blocks, row-major, nothing between rows (ggml's
 * block_q4_K, block_q5_K, block_q6_K; little-endian, fp16 scales):
 *   Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and eight 6-bit
 *     mins m (get_scale_min_k4: bytes 0-3 / 4-7 hold sc 0-3 / m 0-3 in their low 6 bits and
 *     the top 2 bits of sc 4-7 / m 4-7; bytes 8-11 the low nibbles of sc 4-7 and, high, of
 *     m 4-7), 128 bytes qs: 64-value chunk c (c < 4) is bytes 32c..32c+31, low nibbles
 *     elements 0-31 (sub-block 2c), high nibbles elements 32-63 (sub-block 2c + 1).
 *     Sub-block j (32 values) has w = d * sc[j] * q - dmin * m[j], q in 0..15.
 *   Q5_K, 176 bytes: d, dmin, the 12 scale bytes, qh[32], qs[128] as Q4_K; element l of
 *     sub-block j has its fifth bit (16) in bit j of qh[l]; q in 0..31.
 *   Q6_K, 210 bytes: ql[128], qh[64], 16 int8 scales (one per 16 values), fp16 d. Half h
 *     (128 values) reads ql[64h..64h+63] and qh[32h..32h+31]; with l < 32 its values are
 *       l:      ql[l] low nibble      | (qh[l] bits 0-1) << 4
 *       l + 32: ql[l + 32] low nibble | (qh[l] bits 2-3) << 4
 *       l + 64: ql[l] high nibble     | (qh[l] bits 4-5) << 4
 *       l + 96: ql[l + 32] high       | (qh[l] bits 6-7) << 4
 *     and w = d * sc[i / 16] * (q - 32), q in 0..63.
 *
 * The math. A super-block's activations are 256 int8 a with one scale da, kept as 8 blocks
 * of 32 with equal scales (da [M][K / 32], what the AVX2 and scalar tiles read per block). Q4_K
 * / Q5_K sub-block j lines up with activation block j: it adds da * (d * sc_j * sum(q a) -
 * dmin * m_j * sum(a)); the second half is dmin * m_j * sa_j with sa_j = da * sum(a) (bs_j,
 * the int16 sum(a), for the VNNI tile), made once per call for every block of x. Q6_K's
 * activation block j covers its 16-value groups 2j and 2j + 1: the paths whose byte products
 * take unsigned weights (vpmaddubsw) multiply q as it is and subtract 32 * sum(a) per group
 * afterwards, from per-call sums (bs_g, the int16 sum of group g's a: 32 * sum_g sc_g * bs_g
 * leaves the super-block's int32 sums before they are scaled; the scalar tile sums (q - 32) a
 * as it goes). The integer dots are exact on every path: the paths differ only in the order
 * (and grouping) of the fp32 sums.
 *
 * Paths (the one ae_quant_set_path says, as quant_legacy.c's products):
 *   AVX512-VNNI: a super-block's 256 values as 4 zmm of unsigned bytes; per zmm one vpmaddubsw
 *     against 64 activation bytes and one vpdpwssd by the pairs' int16 scales into one int32
 *     vector per super-block, converted and scaled by d * da once (see tile_vnni). Q4_K / Q5_K
 *     hold sub-blocks 2c and 2c + 2 in the low and high nibbles' zmm of one 64-byte load
 *     (chunks c, c + 1), so the activations are laid out per call in that order (sub-blocks
 *     0 2 1 3 4 6 5 7); Q6_K's unpacking yields values in order. Q5_K's fifth bits are a
 *     byte-mask test of qh against each sub-block's bit and a masked add of 16. Needs
 *     AVX512BW as well (always there beside VNNI); without it, the AVX2 path runs.
 *   AVX2: one ymm (32 values) at a time: vpmaddubsw (unsigned q by signed a, pairs at most
 *     2 * 63 * 127: no saturation), vpmaddwd by the integer scales (Q6_K: the two groups'
 *     scales in the two halves, by a vpshufb of the even and odd scales) into the
 *     super-block's int32 sums, converted and scaled by d * da in one FMA per super-block.
 *     Q6_K's offset and its scales so (instead of fp32 per-group sums and two broadcasts per
 *     ymm): 73 -> 54 cycles a super-block in the L1 on AMD Zen 1 (a C loop of the tile).
 *   Scalar: plain loops over the unpacked values, Q6_K's (q - 32) exact in int32 (any CPU;
 *     a build without AVX2); one copy per format with R and C at run time.
 *
 * Work: as quant_legacy.c: items of ROWS_PER_ITEM weight rows on linear.c's pool for up to
 * AE_POOL_MAX_ROWS rows of x, else on OpenMP; within an item, tiles of up to 4 rows of x by
 * one weight row (tile_cols; the scalar path 4), each super-block unpacked once per tile and
 * used for all its rows of x. Only the tile shapes item_rows asks for are specialised (see
 * tile_rc): each copy costs build time, a lot of it under the sanitizers.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define HAVE_VNNI 1
#endif
#endif

#include "ae_kernels.h"
#include "ae_vec.h"
#include "kquant_blocks.h"
#include "linear.h"
#include "pool.h"

#define QK 32   /* activation values per block */
#define QKK 256 /* weight values per super-block */
#define ROWS_PER_ITEM 16
#define MAX_R 4 /* rows of x per tile */
#define MAX_C 4 /* weight rows per tile */
/* Software prefetch this far ahead of the weight loads, into L2 (prefetcht1), as
 * quant_legacy.c (see there). */
#define PREFETCH_BYTES 8192

enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2 };

static ALWAYS_INLINE int64_t sb_bytes(int fmt) {
    return fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
}

static ALWAYS_INLINE float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* ---- activations ---- */

/*
 * What the tiles read of x's quantized rows: a [M][K] the int8 values (on the VNNI path for
 * Q4_K / Q5_K, each super-block's 32-value blocks in the order 0 2 1 3 4 6 5 7; else as they
 * are), da [M][K / 32] their scales (8 equal ones per super-block), bs [M][ns] the integer
 * sums of a per block (Q4_K / Q5_K, ns = K / 32) or 16-value group (Q6_K, ns = K / 16), and
 * for Q4_K / Q5_K sa [M][ns] those sums times their da (sa_j, see the top).
 */
struct kq_rows {
    const int8_t *a;
    const float *da;
    const float *sa;
    const int16_t *bs;
    int64_t K, nb, ns;
};

/* x's quantized rows qa, da (M rows of K) as struct kq_rows for format fmt in buf (sa, bs: ns
 * floats and ns int16 per row; a: M * K bytes where `reorder`, else qa itself). */
static struct kq_rows prepare_rows(int fmt, int reorder, const int8_t *qa, const float *da,
                                   int64_t M, int64_t K, float *sa, int16_t *bs, int8_t *a) {
    const int64_t nb = K / QK, ns = fmt == FMT_Q6_K ? 2 * nb : nb;
    for (int64_t m = 0; m < M; m++) {
        const int8_t *q = qa + m * K;
        for (int64_t g = 0; g < ns; g++) {
            const int n = fmt == FMT_Q6_K ? 16 : 32;
            int32_t s = 0; /* |s| <= 32 * 127: an int16 */
            for (int i = 0; i < n; i++) s += q[g * n + i];
            bs[m * ns + g] = (int16_t)s;
            if (fmt != FMT_Q6_K) sa[m * ns + g] = da[m * nb + g] * (float)s;
        }
        if (reorder) {
            static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
            for (int64_t b = 0; b < K / QKK; b++)
                for (int s = 0; s < 8; s++)
                    memcpy(a + m * K + b * QKK + s * QK, q + b * QKK + order[s] * QK, QK);
        }
    }
    return (struct kq_rows){reorder ? a : qa, da, sa, bs, K, nb, ns};
}

/* ---- scales ---- */

#ifdef HAVE_AVX2
/* The same, four bytes at a time (x86 is little-endian): sc in the low 8 bytes of the
 * result, m in the next 8. Per byte: bits 6-7 of bytes 0-3 (4-7) are the top bits of sc 4-7
 * (m 4-7); a shift of the 32-bit word moves each byte's bits within that byte once masked. */
static ALWAYS_INLINE __m128i k4_scales_x86(const uint8_t *s) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t sc_lo = u0 & 0x3f3f3f3fu, m_lo = u1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi);
}

static ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---- scalar tile ---- */

/* res[r * res_st + c] = x row r times weight row c (w + c * row_bytes), r < R, c < C. */
static ALWAYS_INLINE void tile_scalar(const int fmt, const int R, const int C, const uint8_t *w,
                                      int64_t row_bytes, int64_t nsb, const struct kq_rows *x,
                                      float *res, int64_t res_st) {
    const int64_t bb = sb_bytes(fmt);
    float acc[MAX_R][MAX_C] = {{0}};
    for (int64_t b = 0; b < nsb; b++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + b * bb;
            uint8_t q[QKK], sc[8], mn[8];
            unpack_sb(fmt, blk, q);
            if (fmt != FMT_Q6_K) k4_scales(blk + 4, sc, mn);
            for (int r = 0; r < R; r++) {
                const int8_t *a = x->a + r * x->K + b * QKK;
                const float *da = x->da + r * x->nb + b * 8;
                float sum = 0.0f;
                for (int j = 0; j < 8; j++) {
                    if (fmt == FMT_Q6_K) { /* the two groups' exact sums of (q - 32) a */
                        const int8_t *s6 = (const int8_t *)blk + 192;
                        int32_t s0 = 0, s1 = 0;
                        for (int i = 0; i < 16; i++) {
                            s0 += (q[32 * j + i] - 32) * a[32 * j + i];
                            s1 += (q[32 * j + 16 + i] - 32) * a[32 * j + 16 + i];
                        }
                        const int32_t s = s6[2 * j] * s0 + s6[2 * j + 1] * s1;
                        sum += (float)s * (f16_at(blk + 208) * da[j]);
                    } else {
                        int32_t s = 0;
                        for (int i = 0; i < 32; i++) s += q[32 * j + i] * a[32 * j + i];
                        const float *sa = x->sa + r * x->ns + b * 8;
                        sum += (float)(sc[j] * s) * (f16_at(blk) * da[j]) -
                               f16_at(blk + 2) * (float)mn[j] * sa[j];
                    }
                }
                acc[r][c] += sum;
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) res[r * res_st + c] = acc[r][c];
}

/* ---- AVX2 tile ---- */

#ifdef HAVE_AVX2
/* The lines PREFETCH_BYTES past super-block blk into L2: a super-block's 144-210 bytes. */
static ALWAYS_INLINE void prefetch_ahead(const int fmt, const uint8_t *blk) {
    const char *p = (const char *)blk + PREFETCH_BYTES;
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
    _mm_prefetch(p + 128, _MM_HINT_T1);
    if (fmt == FMT_Q6_K) _mm_prefetch(p + 192, _MM_HINT_T1);
}

/* Bit j of each byte of v as 16 (0 elsewhere): a 16-bit shift moves each byte's bit j to its
 * bit 4 (bits crossing from the neighbouring byte land elsewhere and are masked off). */
static ALWAYS_INLINE __m256i bit_as_16(__m256i v, const int j) {
    const __m256i s = j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4);
    return _mm256_and_si256(s, _mm256_set1_epi8(16));
}

/* Values 32j..32j+31 of a Q6_K super-block as unsigned bytes (see the top's table: a 16-bit
 * shift of qh brings each byte's two bits to bits 4-5 of the same byte). */
static ALWAYS_INLINE __m256i q6_part(const uint8_t *blk, const int j) {
    const int h = j / 4, t = j % 4;
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = t < 2 ? _mm256_and_si256(l, m4)
                             : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    const __m256i hi = t == 0   ? _mm256_slli_epi16(qh, 4)
                       : t == 1 ? _mm256_slli_epi16(qh, 2)
                       : t == 2 ? qh
                                : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
}

/* A Q6_K super-block's 16 int8 scales (s8) as int16, the even groups' in the low half and the
 * odd groups' in the high half: a vpshufb then takes group 2j's and 2j + 1's scales to the
 * two halves of a ymm. */
static ALWAYS_INLINE __m256i q6_scales(__m128i s8) {
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, even_odd));
}

static ALWAYS_INLINE void tile_avx2(const int fmt, const int R, const int C, const uint8_t *w,
                                    int64_t row_bytes, int64_t nsb, const struct kq_rows *x,
                                    float *res, int64_t res_st) {
    const int64_t bb = sb_bytes(fmt);
    __m256 acc[MAX_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + b * bb;
            prefetch_ahead(fmt, blk);
            float d;
            int16_t sc[8];       /* Q4_K / Q5_K: the sub-blocks' scales */
            __m256i eo = _mm256_setzero_si256(); /* Q6_K: see q6_scales */
            /* the super-block's sum of sc * q * a, in int32 lanes (at most 8 * 2 * 63 * 63 *
             * 127 for Q4_K / Q5_K's six-bit scales, 8 * 2 * 63 * 127 * 128 for Q6_K's int8
             * ones, less Q6_K's offset below): one conversion and one FMA by d * da per
             * super-block, da being one per 256 values (ae_quantize_rows_q8k writes it 8
             * times) */
            __m256i isum[MAX_R];
            if (fmt == FMT_Q6_K) {
                d = f16_at(blk + 208);
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
                eo = q6_scales(s8);
                /* q - 32: 32 * sum_g sc_g * bs_g, groups 2i and 2i + 1 in int32 lane i (at
                 * most 2 * 128 * 16 * 128 = 2^19 before the shift) */
                const __m256i s16 = _mm256_cvtepi8_epi16(s8);
                for (int r = 0; r < R; r++) {
                    const int16_t *bs_r = x->bs + r * x->ns + b * 16;
                    const __m256i bs = _mm256_loadu_si256((const __m256i *)bs_r);
                    isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                               _mm256_slli_epi32(_mm256_madd_epi16(s16, bs), 5));
                }
            } else {
                d = f16_at(blk);
                const __m128i s = k4_scales_x86(blk + 4);
                _mm_storeu_si128((__m128i *)sc, _mm_cvtepu8_epi16(s));
                const __m256 off = _mm256_mul_ps(
                    _mm256_set1_ps(f16_at(blk + 2)),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(s, 8))));
                for (int r = 0; r < R; r++) {
                    const float *sa = x->sa + r * x->ns + b * 8;
                    acc[r][c] = _mm256_sub_ps(acc[r][c], _mm256_mul_ps(off, _mm256_loadu_ps(sa)));
                    isum[r] = _mm256_setzero_si256();
                }
            }
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i q, s;
                if (fmt == FMT_Q6_K) {
                    q = q6_part(blk, j);
                    /* int16 lanes 0-7 are group 2j's pairs, 8-15 group 2j + 1's: element j of
                     * each half of eo */
                    const short pick = (short)(0x0100 * (2 * j + 1) + 2 * j);
                    s = _mm256_shuffle_epi8(eo, _mm256_set1_epi16(pick));
                } else {
                    const uint8_t *qs = blk + (fmt == FMT_Q4_K ? 16 : 48) + 32 * (j / 2);
                    const __m256i l = _mm256_loadu_si256((const __m256i *)qs);
                    q = j % 2 ? _mm256_srli_epi16(l, 4) : l;
                    q = _mm256_and_si256(q, _mm256_set1_epi8(15));
                    if (fmt == FMT_Q5_K)
                        q = _mm256_or_si256(
                            q, bit_as_16(_mm256_loadu_si256((const __m256i *)(blk + 16)), j));
                    s = _mm256_set1_epi16(sc[j]);
                }
                for (int r = 0; r < R; r++) {
                    const __m256i a =
                        _mm256_loadu_si256((const __m256i *)(x->a + r * x->K + b * QKK + 32 * j));
                    isum[r] = _mm256_add_epi32(
                        isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), s));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 da = _mm256_set1_ps(d * x->da[r * x->nb + b * 8]);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), da, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) res[r * res_st + c] = hsum8(acc[r][c]);
}
#endif

/* ---- AVX512-VNNI tile ---- */

#ifdef HAVE_VNNI
/* A 32-byte qh as both halves of a zmm. */
static ALWAYS_INLINE __m512i load_qh(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* A super-block's 256 values as 4 zmm of unsigned bytes, lined up with struct kq_rows. */
static ALWAYS_INLINE void unpack_vnni(const int fmt, const uint8_t *blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    if (fmt == FMT_Q6_K) {
        const __m512i m30 = _mm512_set1_epi8(0x30);
        /* 16-bit shifts of qh bring each byte's two bits to its bits 4-5: values l (low half
         * of the zmm) by << 4, l + 32 (high half) by << 2; l + 64 by 0, l + 96 by >> 2 */
        const __m512i up = _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004,
                                             0x0004000400040004, 0x0004000400040004,
                                             0x0002000200020002, 0x0002000200020002,
                                             0x0002000200020002, 0x0002000200020002);
        const __m512i down = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002,
                                               0x0002000200020002, 0x0002000200020002,
                                               0x0002000200020002);
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(blk + 64 * h);
            const __m512i qh = load_qh(blk + 128 + 32 * h);
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                       _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30));
            q[2 * h + 1] =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30));
        }
        return;
    }
    const uint8_t *qs = blk + (fmt == FMT_Q4_K ? 16 : 48);
    for (int h = 0; h < 2; h++) { /* chunks 2h, 2h + 1: sub-blocks (4h, 4h+2), (4h+1, 4h+3) */
        const __m512i l = _mm512_loadu_si512(qs + 64 * h);
        q[2 * h] = _mm512_and_si512(l, m4);
        q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
    }
    if (fmt == FMT_Q5_K) { /* sub-block j's fifth bits are bit j of qh's bytes */
        const __m512i qh = load_qh(blk + 16), sixteen = _mm512_set1_epi8(16);
        for (int k = 0; k < 4; k++) {
            const int j0 = (k / 2) * 4 + k % 2, j1 = j0 + 2;
            const __m512i bit = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << j0))),
                _mm256_set1_epi8((char)(1 << j1)), 1);
            q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(qh, bit), q[k], sixteen);
        }
    }
}

/* Which of the 8 (Q4_K / Q5_K: sub-blocks) or 16 (Q6_K: groups of 16) int16 scales each
 * 16-bit lane of zmm k's pair sums takes (see unpack_vnni: Q4_K / Q5_K's zmm k holds
 * sub-blocks j0 in bytes 0-31 and j0 + 2 in 32-63; Q6_K's, values 64k..64k+63 in order). */
static ALWAYS_INLINE __m512i scale_words(const int fmt, const int k) {
    int16_t idx[32];
    for (int w = 0; w < 32; w++) {
        const int j0 = (k / 2) * 4 + k % 2;
        idx[w] = (int16_t)(fmt == FMT_Q6_K ? 4 * k + w / 8 : w < 16 ? j0 : j0 + 2);
    }
    return _mm512_loadu_si512(idx); /* a constant once inlined and unrolled */
}

/*
 * R rows of x against C weight rows on AVX512-VNNI, x quantized with one scale per super-block
 * (ae_quantize_rows_q8k). Per super-block, weight row and row of x: vpmaddubsw of the unsigned
 * q by the activations into int16 pairs (at most 2 * 63 * 127: no saturation), vpdpwssd of
 * those by the pairs' int16 scales (sc, one permute per zmm per weight row) into int32 lanes,
 * so that the super-block's sum of sc * q * a is one integer vector; one conversion and one
 * FMA by d * da. The constant parts are integers too: Q4_K / Q5_K's sum of m_j times the
 * sub-block sums of a (vpmaddwd, its own fp32 sums by dmin * da), Q6_K's 32 * sum of sc_g
 * times the group sums of a (subtracted from the integer vector before the conversion).
 */
static ALWAYS_INLINE void tile_vnni(const int fmt, const int R, const int C, const uint8_t *w,
                                    int64_t row_bytes, int64_t nsb, const struct kq_rows *x,
                                    float *res, int64_t res_st) {
    const int64_t bb = sb_bytes(fmt);
    __m512 acc[MAX_R][MAX_C];
    __m128 accm[MAX_R][MAX_C]; /* Q4_K / Q5_K: dmin * da * the m terms */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            acc[r][c] = _mm512_setzero_ps();
            accm[r][c] = _mm_setzero_ps();
        }
    for (int64_t b = 0; b < nsb; b++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + b * bb;
            prefetch_ahead(fmt, blk);
            __m512i q[4], sc[4], s16;
            __m128i mins = _mm_setzero_si128();
            __m128 dd; /* d (and Q4_K / Q5_K's dmin) in lanes 0 (and 1) */
            unpack_vnni(fmt, blk, q);
            if (fmt == FMT_Q6_K) {
                s16 = _mm512_castsi256_si512(
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
                dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const uint16_t *)(blk + 208)));
            } else {
                const __m128i s = k4_scales_x86(blk + 4);
                s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(s));
                mins = _mm_cvtepu8_epi16(_mm_srli_si128(s, 8));
                int32_t both;
                memcpy(&both, blk, 4);
                dd = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                sc[k] = _mm512_permutexvar_epi16(scale_words(fmt, k), s16);
            for (int r = 0; r < R; r++) {
                const int8_t *a = x->a + r * x->K + b * QKK;
                /* d * da, dmin * da */
                const __m128 dda = _mm_mul_ps(dd, _mm_set1_ps(x->da[r * x->nb + b * 8]));
                const int16_t *bs = x->bs + r * x->ns + b * (fmt == FMT_Q6_K ? 16 : 8);
                __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    isum = _mm512_dpwssd_epi32(
                        isum, _mm512_maddubs_epi16(q[k], _mm512_loadu_si512(a + 64 * k)), sc[k]);
                if (fmt == FMT_Q6_K) {
                    const __m256i corr = _mm256_madd_epi16(
                        _mm512_castsi512_si256(s16), _mm256_loadu_si256((const __m256i *)bs));
                    isum = _mm512_sub_epi32(isum,
                                            _mm512_zextsi256_si512(_mm256_slli_epi32(corr, 5)));
                } else {
                    const __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)bs));
                    accm[r][c] = _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_permute_ps(dda, 0x55),
                                              accm[r][c]);
                }
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_broadcastss_ps(dda),
                                            acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            __m128 m = _mm_add_ps(accm[r][c], _mm_movehl_ps(accm[r][c], accm[r][c]));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            res[r * res_st + c] = _mm512_reduce_add_ps(acc[r][c]) - _mm_cvtss_f32(m);
        }
}
#endif

/* ---- tiles with constant R, C ---- */

/* The scalar tile, R and C at run time: one copy per format (it runs where AVX2 is missing,
 * and in tests; specialising it would triple the file's build time for nothing). */
static __attribute__((noinline)) void tile_scalar_any(const int fmt, int R, int C,
                                                      const uint8_t *w, int64_t row_bytes,
                                                      int64_t nsb, const struct kq_rows *x,
                                                      float *res, int64_t res_st) {
    if (fmt == FMT_Q4_K) tile_scalar(FMT_Q4_K, R, C, w, row_bytes, nsb, x, res, res_st);
    else if (fmt == FMT_Q5_K) tile_scalar(FMT_Q5_K, R, C, w, row_bytes, nsb, x, res, res_st);
    else tile_scalar(FMT_Q6_K, R, C, w, row_bytes, nsb, x, res, res_st);
}

static ALWAYS_INLINE void tile_simd(const int fmt, const int path, const int R, const int C,
                                    const uint8_t *w, int64_t row_bytes, int64_t nsb,
                                    const struct kq_rows *x, float *res, int64_t res_st) {
#ifdef HAVE_VNNI
    if (path == PATH_VNNI) {
        tile_vnni(fmt, R, C, w, row_bytes, nsb, x, res, res_st);
        return;
    }
#endif
#ifdef HAVE_AVX2
    (void)path;
    tile_avx2(fmt, R, C, w, row_bytes, nsb, x, res, res_st);
#else
    (void)fmt, (void)path, (void)R, (void)C, (void)w, (void)row_bytes, (void)nsb, (void)x;
    (void)res, (void)res_st;
    abort(); /* no SIMD path in this build: never chosen */
#endif
}

/* The SIMD tiles item_rows asks for (tile_cols): R x 1. One inlined copy of each per (fmt,
 * path). */
#define TILE_CASE(R, C)                                                    \
    case (R) * 8 + (C):                                                    \
        tile_simd(fmt, path, R, C, w, row_bytes, nsb, x, res, res_st);     \
        return;

static ALWAYS_INLINE void tile_rc(const int fmt, const int path, int R, int C, const uint8_t *w,
                                  int64_t row_bytes, int64_t nsb, const struct kq_rows *x,
                                  float *res, int64_t res_st) {
    if (path == PATH_SCALAR) {
        tile_scalar_any(fmt, R, C, w, row_bytes, nsb, x, res, res_st);
        return;
    }
    switch (R * 8 + C) {
        TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)
        default: abort();
    }
}

/* Weight rows per tile: one (a scalar path's tile, four). One row's super-blocks are one
 * stream front to back, which the hardware prefetchers follow: 1 x 4 and R x 2 tiles ran
 * 1.3-1.6x slower at one row and 1.1-1.2x at 2-8 (AMD Zen 4, 2 cores). */
static ALWAYS_INLINE int tile_cols(int path, int64_t M) {
    (void)M;
    return path != PATH_SCALAR ? 1 : 4;
}

/* ---- the product, item by item ---- */

struct kquant_job {
    const uint8_t *w;
    struct kq_rows x;
    const void *bias;
    void *out;
    int64_t M, N, o_st, per_item;
    int fmt, path, dt;
};

static ALWAYS_INLINE void item_rows(const struct kquant_job *j, const int fmt, const int path,
                                    int64_t n0, int64_t n1, float *res) {
    const int64_t K = j->x.K, nsb = K / QKK, row_bytes = nsb * sb_bytes(fmt), cols = n1 - n0;
    const int cmax = tile_cols(path, j->M);
    for (int64_t m = 0; m < j->M; m += MAX_R) {
        const int R = j->M - m < MAX_R ? (int)(j->M - m) : MAX_R;
        const struct kq_rows x = {j->x.a + m * K, j->x.da + m * j->x.nb, j->x.sa + m * j->x.ns,
                                  j->x.bs + m * j->x.ns, K, j->x.nb, j->x.ns};
        int64_t n = n0;
        for (; n + cmax <= n1; n += cmax)
            tile_rc(fmt, path, R, cmax, j->w + n * row_bytes, row_bytes, nsb, &x,
                    res + m * cols + n - n0, cols);
        for (; n < n1; n++) /* the item's last rows, one at a time */
            tile_rc(fmt, path, R, 1, j->w + n * row_bytes, row_bytes, nsb, &x,
                    res + m * cols + n - n0, cols);
    }
}

#define FMT_PATHS(fmt)                                                        \
    do {                                                                      \
        if (j->path == PATH_VNNI) item_rows(j, fmt, PATH_VNNI, n0, n1, res);  \
        else if (j->path == PATH_AVX2) item_rows(j, fmt, PATH_AVX2, n0, n1, res); \
        else item_rows(j, fmt, PATH_SCALAR, n0, n1, res);                     \
    } while (0)

static void kquant_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct kquant_job *j = ctx;
    const int64_t n0 = item * j->per_item;
    const int64_t n1 = n0 + j->per_item < j->N ? n0 + j->per_item : j->N, cols = n1 - n0;
    float *res = ae_thread_scratch((size_t)(j->M * cols + cols));
    if (j->fmt == FMT_Q4_K) FMT_PATHS(FMT_Q4_K);
    else if (j->fmt == FMT_Q5_K) FMT_PATHS(FMT_Q5_K);
    else FMT_PATHS(FMT_Q6_K);
    ae_commit_rows(commit, res, j->M, cols, j->bias, j->dt, j->out, j->o_st, n0);
}

/* Bit f set for each K-quant format code f this file runs. */
int ae_kquant_formats(void) { return (1 << FMT_Q4_K) | (1 << FMT_Q5_K) | (1 << FMT_Q6_K); }

/* ae_linear_quant (quant_legacy.c) for fmt 5 Q4_K, 6 Q5_K, 7 Q6_K: the same arguments and
 * returns; -2 where K is not a positive multiple of 256. */
int ae_linear_kquant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                     int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                     int num_threads) {
    if (fmt < FMT_Q4_K || fmt > FMT_Q6_K) return -3;
    if (K % QKK != 0 || K <= 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    int path = ae_quant_set_path(-2); /* quant_legacy.c's choice */
#ifndef HAVE_VNNI
    if (path == PATH_VNNI) path = PATH_AVX2; /* VNNI without AVX512BW: not built here */
#endif
    const int64_t nb = K / QK, ns = fmt == FMT_Q6_K ? 2 * nb : nb;
    const int reorder = path == PATH_VNNI && fmt != FMT_Q6_K;
    /* the rows where the item's threads read them: the pool's buffer when the caller holds
     * the pool (a late helper may read it after this call), else fresh memory */
    const size_t q_bytes = (size_t)(M * K), d_bytes = (size_t)(M * nb) * sizeof(float);
    const size_t s_bytes = (size_t)(M * ns) * (sizeof(float) + sizeof(int16_t));
    const size_t bytes = q_bytes * (reorder ? 2 : 1) + d_bytes + s_bytes;
    const int pooled = ae_linear_use_pool(M, num_threads);
    char *buf = pooled ? ae_pool_buffer(0, bytes) : malloc(bytes);
    if (buf == NULL) {
        if (pooled) ae_pool_release();
        return -1;
    }
    /* floats first (aligned), then the int16 sums, then the bytes */
    float *da = (float *)buf, *sa = da + M * nb;
    int16_t *bs = (int16_t *)(sa + M * ns);
    int8_t *qa = (int8_t *)(bs + M * ns), *reordered = qa + q_bytes;
    ae_quantize_rows_q8k(dt, x, x_st, M, K, qa, da, pooled ? 1 : num_threads);
    const struct kq_rows rows = prepare_rows(fmt, reorder, qa, da, M, K, sa, bs, reordered);
    int64_t per_item = ROWS_PER_ITEM;
    while ((N + per_item - 1) / per_item > AE_POOL_MAX_ITEMS) per_item += ROWS_PER_ITEM;
    const struct kquant_job job = {w, rows, bias, out, M, N, o_st, per_item, fmt, path, dt};
    ae_linear_run_items(pooled, kquant_item, &job, sizeof job, (N + per_item - 1) / per_item,
                        num_threads);
    if (pooled) ae_pool_release();
    else free(buf);
    return 0;
}
