/*
 * The panel GEMM of quant_gemm.c on AVX2 (machines without AVX512-VNNI): the same items (a
 * panel of 32 weight rows, GEMM_KC values of K at a time), the same prepared rows of x and
 * the same sums per sub-block, with vpmaddubsw for the integer products. There the tiles of
 * quant_legacy.c and quant_kquants.c pay a horizontal sum and a scale product per block and
 * row of x, and many-row products dequantized the weight for torch's float GEMM instead
 * (twice the weight's passes, fp32 multiplies).
 *
 * A panel chunk is two halves of 16 weight rows; a group of 4 values of a half is 64 bytes,
 * row i's 4 values at bytes 4 i (two ymm of 8 rows). A row of x's 4 values, broadcast, meet a
 * ymm in one vpmaddubsw (u unsigned by a signed) into 16 int16 pairs, each the sum of 2
 * products of one weight row. The pairs of H groups add up in int16 before one vpmaddwd by
 * ones makes them int32, H as large as no sum can overflow: a pair is at most 2 * 15 * 127
 * for 4-bit u (H = 8), 2 * 31 * 127 for 5-bit (4), 2 * 63 * 127 for Q6_K's 6 bits (2).
 * Q8_0's values go in signed, as |q| with a taking q's sign (vpsignb, as quant_legacy.c's
 * AVX2 tile): a pair is at most 2 * 128 * 127, one group at a time, and no offset.
 */
#include <stdint.h>
#include <string.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "kquant_blocks.h"
#include "linear.h"
#include "quant_gemm.h"

#ifdef HAVE_GEMM_AVX2
#include <immintrin.h>

#define PANEL GEMM_PANEL
#define KC GEMM_KC
#define FMT GEMM_FMT
#define HALF 16  /* weight rows per tile: two ymm of 8 */
#define GROUP 64 /* bytes of a half panel per 4 values: HALF x 4 */
#define TILE_R 2 /* rows of x per tile: 2 x 2 vectors of fp32, int32 and int16 sums */

/* 32 bytes, 16 where bit j of qh is set for byte j (Q5_0 and Q5_1's fifth bits). */
static ALWAYS_INLINE __m256i fifth_bits(uint32_t qh) {
    const __m256i sel = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                           0x0303030303030303);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), sel); /* byte j: qh's j / 8 */
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));   /* all but bit j % 8 */
    v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* One block of format `fmt` at b: its values' u into u (values bytes), each sub-block's d_s
 * into sc and m_s into mn (formats with a minimum); Q8_0's u are its signed q. As
 * quant_gemm.c's unpack_block, in AVX2. */
static ALWAYS_INLINE void unpack_block(const int fmt, const uint8_t *restrict b,
                                       uint8_t *restrict u, float *restrict sc,
                                       float *restrict mn) {
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (fmt) {
    case 0: /* Q8_0: d, qs[32] */
        sc[0] = gemm_f16_at(b);
        memcpy(u, b + 2, 32);
        break;
    case AE_QUANT_Q5_0_BYTES: /* d, qs[32]: q - 16, unpacked as Q5_0's q */
        sc[0] = gemm_f16_at(b);
        _mm256_storeu_si256((__m256i *)u,
                            _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                            _mm256_set1_epi8(16)));
        break;
    case 1:   /* Q4_0: d, qs[16] */
    case 2:   /* Q4_1: d, m, qs[16] */
    case 3:   /* Q5_0: d, qh, qs[16] */
    case 4: { /* Q5_1: d, m, qh, qs[16]; low nibbles elements 0-15, high ones 16-31 */
        const int m = fmt == 2 || fmt == 4, h = fmt == 3 || fmt == 4;
        sc[0] = gemm_f16_at(b);
        if (m) mn[0] = gemm_f16_at(b + 2);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * m + 4 * h));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        if (h) {
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * m, 4);
            q = _mm256_or_si256(q, fifth_bits(qh));
        }
        _mm256_storeu_si256((__m256i *)u, q);
        break;
    }
    case 5:   /* Q4_K: d, dmin, the 12 scale bytes, qs[128] */
    case 6: { /* Q5_K: the same with qh[32] before qs */
        const float d = gemm_f16_at(b), dmin = gemm_f16_at(b + 2);
        uint8_t s[8], mins[8];
        k4_scales(b + 4, s, mins);
        for (int j = 0; j < 8; j++) {
            sc[j] = d * (float)s[j];
            mn[j] = -dmin * (float)mins[j];
        }
        const uint8_t *qs = b + (fmt == 5 ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int c = 0; c < 4; c++) { /* values 64c + l: qs[32c + l]'s low nibble, + 32: high */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(q, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (fmt == 6) { /* plus 16 where bit 2c (2c + 1) of qh[l] is set */
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c)));
                const __m256i b1 = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
                const __m256i v16 = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(
                    lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), v16));
                hi = _mm256_or_si256(
                    hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), v16));
            }
            _mm256_storeu_si256((__m256i *)(u + 64 * c), lo);
            _mm256_storeu_si256((__m256i *)(u + 64 * c + 32), hi);
        }
        break;
    }
    default: { /* Q6_K: ql[128], qh[64], scales[16] (int8), d; 16-value group t's scale is t's */
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = gemm_f16_at(b + 208);
        for (int t = 0; t < 16; t++) sc[t] = d * (float)scales[t];
        const __m256i m2 = _mm256_set1_epi8(0x30); /* a high pair at bits 4-5 */
        for (int h = 0; h < 2; h++) { /* as kquant_blocks.h's unpack_sb */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            uint8_t *o = u + 128 * h;
            _mm256_storeu_si256((__m256i *)o,
                                _mm256_or_si256(_mm256_and_si256(l0, m4),
                                                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)));
            _mm256_storeu_si256((__m256i *)(o + 32),
                                _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)));
            _mm256_storeu_si256(
                (__m256i *)(o + 64),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                _mm256_and_si256(qh, m2)));
            _mm256_storeu_si256(
                (__m256i *)(o + 96),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)));
        }
        break;
    }
    }
}

GEMM_UNPACK_ROWS

/* 8 rows of u (row stride K) by 32 values from k into the half panel: dword g of row i goes
 * to bytes 4 i of dst + g * GROUP (dst: the half's group k / 4, plus 32 for its rows 8-15).
 * An 8 x 8 transpose of dwords. */
static inline void transpose_8(const uint8_t *u, int64_t K, uint8_t *dst) {
    __m256i r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(u + i * K));
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);     /* dwords 0, 1 | 4, 5 of i, i + 1 */
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* dwords 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);         /* dword 0 | 4 of rows i .. i + 3 */
        s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);     /* 1 | 5 */
        s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]); /* 2 | 6 */
        s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]); /* 3 | 7 */
    }
    for (int g = 0; g < 4; g++) {
        _mm256_store_si256((__m256i *)(dst + g * GROUP),
                           _mm256_permute2x128_si256(s[g], s[g + 4], 0x20));
        _mm256_store_si256((__m256i *)(dst + (g + 4) * GROUP),
                           _mm256_permute2x128_si256(s[g], s[g + 4], 0x31));
    }
}

/* R rows of x (from row m) over a half panel's values k0 .. k0 + kc: res[r][0..15] (row
 * stride PANEL) = their fp32 sums, added to what res holds unless `first`. sc, mn: the half's
 * columns of the scales (row stride PANEL). SB: sub-block values; H: groups of 4 values summed
 * in int16; sgn: signed values (Q8_0). */
static ALWAYS_INLINE void tile(const int R, const int SB, const int H, const int has_min,
                               const int sgn, const uint8_t *restrict panel,
                               const float *restrict sc, const float *restrict mn,
                               const struct gemm_rows *x, int64_t m, int64_t k0, int64_t kc,
                               int first, float *restrict res, const struct gemm_pf *pf) {
    const int64_t K = x->K, S = x->S, nb = K / 32, s0 = k0 / SB;
    const int8_t *qa = x->qa + m * K + k0;
    const float *da = x->da + m * nb + k0 / 32, *fa = x->fa ? x->fa + m * S + s0 : NULL;
    const int32_t *init = x->init + m * S + s0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_R][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2; c++)
            acc[r][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(res + r * PANEL + 8 * c);
    const int64_t pf_step = pf ? (pf->to - pf->from + kc / SB - 1) / (kc / SB) : 0;
    int64_t line = pf ? pf->from : 0;
    for (int64_t s = 0; s < kc / SB; s++) {
        for (int64_t j = 0; j < pf_step && line < pf->to; j++, line++)
            _mm_prefetch((const char *)pf->base[line / pf->per] + 64 * (line % pf->per),
                         _MM_HINT_T1);
        __m256i i32[TILE_R][2];
        for (int r = 0; r < R; r++) i32[r][0] = i32[r][1] = _mm256_set1_epi32(init[r * S + s]);
        const uint8_t *p = panel + s * (SB / 4) * GROUP;
        const int8_t *a = qa + s * SB;
#pragma GCC unroll 1
        for (int h = 0; h < SB / 4; h += H) {
            __m256i i16[TILE_R][2];
            for (int r = 0; r < R; r++) i16[r][0] = i16[r][1] = _mm256_setzero_si256();
            /* not unrolled: GCC's schedule of 8 unrolled groups kept every product in a
             * register at once and spilled them (x86-64-v3 has 16 vector registers) */
#pragma GCC unroll 4
            for (int g = h; g < h + H; g++) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(p + g * GROUP));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(p + g * GROUP + 32));
                const __m256i u0 = sgn ? _mm256_abs_epi8(w0) : w0;
                const __m256i u1 = sgn ? _mm256_abs_epi8(w1) : w1;
                for (int r = 0; r < R; r++) {
                    int32_t a4;
                    memcpy(&a4, a + r * K + 4 * g, 4);
                    const __m256i ab = _mm256_set1_epi32(a4);
                    const __m256i p0 =
                        _mm256_maddubs_epi16(u0, sgn ? _mm256_sign_epi8(ab, w0) : ab);
                    const __m256i p1 =
                        _mm256_maddubs_epi16(u1, sgn ? _mm256_sign_epi8(ab, w1) : ab);
                    i16[r][0] = _mm256_add_epi16(i16[r][0], p0);
                    i16[r][1] = _mm256_add_epi16(i16[r][1], p1);
                }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 2; c++)
                    i32[r][c] = _mm256_add_epi32(i32[r][c], _mm256_madd_epi16(i16[r][c], ones));
        }
        const __m256 d0 = _mm256_loadu_ps(sc + s * PANEL), d1 = _mm256_loadu_ps(sc + s * PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 db = _mm256_set1_ps(da[r * nb + s * SB / 32]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r][0]), _mm256_mul_ps(d0, db),
                                        acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r][1]), _mm256_mul_ps(d1, db),
                                        acc[r][1]);
        }
        if (has_min) {
            const __m256 m0 = _mm256_loadu_ps(mn + s * PANEL);
            const __m256 m1 = _mm256_loadu_ps(mn + s * PANEL + 8);
            for (int r = 0; r < R; r++) {
                const __m256 f = _mm256_set1_ps(fa[r * S + s]);
                acc[r][0] = _mm256_fmadd_ps(m0, f, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(m1, f, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2; c++) _mm256_storeu_ps(res + r * PANEL + 8 * c, acc[r][c]);
}

/* One function per (rows, kind): the loops above unrolled for each. Kinds: 0 Q8_0; 1 4-bit
 * without a minimum (Q4_0), 2 with (Q4_1, Q4_K); 3 5-bit without (Q5_0), 4 with (Q5_1, Q5_K);
 * 5 Q6_K. */
typedef void (*tile_fn)(const uint8_t *, const float *, const float *, const struct gemm_rows *,
                        int64_t, int64_t, int64_t, int, float *, const struct gemm_pf *);
#define TILE_FN(R, KIND, SB, H, MIN, SGN)                                                      \
    static __attribute__((noinline)) void tile_##R##_##KIND(                                   \
        const uint8_t *p, const float *sc, const float *mn, const struct gemm_rows *x,         \
        int64_t m, int64_t k0, int64_t kc, int first, float *res, const struct gemm_pf *pf) {  \
        tile(R, SB, H, MIN, SGN, p, sc, mn, x, m, k0, kc, first, res, pf);                     \
    }
#define TILE_FNS(KIND, SB, H, MIN, SGN) \
    TILE_FN(1, KIND, SB, H, MIN, SGN) TILE_FN(2, KIND, SB, H, MIN, SGN)
TILE_FNS(0, 32, 1, 0, 1)
TILE_FNS(1, 32, 8, 0, 0)
TILE_FNS(2, 32, 8, 1, 0)
TILE_FNS(3, 32, 4, 0, 0)
TILE_FNS(4, 32, 4, 1, 0)
TILE_FNS(5, 16, 2, 0, 0)

static tile_fn tile_for(int R, int fmt) {
    static const tile_fn fns[6][TILE_R] = {
        {tile_1_0, tile_2_0}, {tile_1_1, tile_2_1}, {tile_1_2, tile_2_2},
        {tile_1_3, tile_2_3}, {tile_1_4, tile_2_4}, {tile_1_5, tile_2_5},
    };
    /* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; Q5_0_BYTES as Q5_0 */
    static const int kind[8] = {0, 1, 2, 3, 4, 2, 4, 5};
    return fns[fmt == AE_QUANT_Q5_0_BYTES ? 3 : kind[fmt]][R - 1];
}

void ae_gemm_panel_avx2(const void *ctx, int64_t p, const struct ae_commit *commit) {
    const struct gemm_job *j = ctx;
    const int fmt = j->fmt;
    const int64_t M = j->M, N = j->N, K = j->K, nb = j->nb;
    const int64_t kc_max = K < KC ? K : KC, m_pad = (M + TILE_R - 1) / TILE_R * TILE_R;
    /* the panel: two halves of 16 rows, as many bytes as u */
    const struct gemm_scratch b = gemm_scratch(j, (size_t)(PANEL * kc_max),
                                               (size_t)(PANEL * kc_max), m_pad);
    uint8_t *u = b.u, *panel = b.panel;
    float *sc = b.sc, *mn = b.mn, *res = b.res;
    const uint8_t *w = j->w;
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const int64_t half_bytes = kc / 4 * GROUP;
        gemm_unpack_chunk(unpack_row, j, n0, cols, k0, kc, u, sc, mn);
        for (int half = 0; half < 2 && HALF * half < cols; half++)
            for (int e = 0; e < 2; e++)
                for (int64_t k = 0; k < kc; k += 32)
                    transpose_8(u + (HALF * half + 8 * e) * kc + k, kc,
                                panel + half * half_bytes + k / 4 * GROUP + 32 * e);
        /* the tiles prefetch the next chunk's weights, each its share (as quant_gemm.c's) */
        struct gemm_pf pf;
        const int prefetch = j->prefetch && (k0 + KC < K || p + 1 < j->panels);
        if (prefetch) gemm_next_chunk(fmt, w, N, nb, p, k0, K, &pf);
        const int halves = cols > HALF ? 2 : 1;
        const int64_t tiles = halves * ((M + TILE_R - 1) / TILE_R), lines = prefetch ? pf.to : 0;
        int64_t t = 0;
        for (int half = 0; half < halves; half++)
            for (int64_t m = 0; m < M; m += TILE_R, t++) {
                const int R = M - m < TILE_R ? (int)(M - m) : TILE_R;
                if (prefetch) {
                    pf.from = lines * t / tiles;
                    pf.to = lines * (t + 1) / tiles;
                }
                tile_for(R, fmt)(panel + half * half_bytes, sc + HALF * half, mn + HALF * half,
                                 &j->xr, m, k0, kc, k0 == 0, res + m * PANEL + HALF * half,
                                 prefetch ? &pf : NULL);
            }
    }
    if (!ae_commit_begin(commit)) return; /* another thread committed this panel */
    ae_store_rows(res, PANEL, M, cols, j->bias, b.bias_row, j->dt, j->out, j->o_st, n0);
    ae_commit_end(commit);
}

#endif
