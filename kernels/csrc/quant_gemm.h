/*
 * What the two panel GEMMs share (quant_gemm.c: AVX512-VNNI; quant_gemm_avx2.c: AVX2): the
 * formats as they unpack, the prepared rows of x and a product's job. Both turn a weight
 * block into unsigned (AVX2's Q8_0: signed) integers u per value and, per sub-block s of SB
 * values, a scale d_s and for formats with a minimum a term m_s, with weight = d_s * (u - o)
 * + m_s; quant_gemm.c's top derives the sums from that.
 */
#ifndef AE_QUANT_GEMM_H
#define AE_QUANT_GEMM_H

#include <stdint.h>
#include <string.h>

#include "ae_kernels.h"
#include "linear.h"
#include "pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_GEMM_AVX2 1
#endif

#define GEMM_PANEL 32 /* weight rows per panel (one work item) */
/* Values of K unpacked at a time (a multiple of every block): the chunk of the panel (32 KB),
 * its unpacked rows (32 KB) and the 4 rows of x stay in L1 / L2 while every row of x runs
 * over it. Whole rows of K = 8192 (256 KB of panel and as much unpacked) ran at 0.6-0.7x the
 * speed of K = 2048's on the same number of products. */
#define GEMM_KC 1024

/* Per format code (quant_formats.FORMATS): values and bytes per block, sub-block values,
 * the integer offset o, whether there is a minimum term. */
struct gemm_fmt {
    int values, bytes, sub, offset, has_min;
};
static const struct gemm_fmt GEMM_FMT[AE_QUANT_FORMATS] = {
    {32, 34, 32, 128, 0}, {32, 18, 32, 8, 0},   {32, 20, 32, 0, 1},   {32, 22, 32, 16, 0},
    {32, 24, 32, 0, 1},   {256, 144, 32, 0, 1}, {256, 176, 32, 0, 1}, {256, 210, 16, 32, 0},
    {256, 144, 32, 0, 1}, /* Q4_K_R8: read 16 rows at a time (r8_pair, r8_scales) */
    {32, 34, 32, 128, 0}, /* Q8_0_R8: the same */
    {32, 22, 32, 16, 0},  /* Q5_0_R8, Q4_0_R8: the same */
    {32, 18, 32, 8, 0},
    {256, 210, 16, 32, 0}, /* Q6_K_R8: the same */
    {32, 34, 32, 16, 0},   /* Q5_0_BYTES: Q5_0's values as unsigned q (+ 16 at the unpack) */
};

/* What the rows of x bring to a product: their int8 values and block scales, and per
 * sub-block the start of the integer sum (-o * A_s, A_s the sum of its int8 values) and, for
 * formats with a minimum, da * A_s. */
struct gemm_rows {
    const int8_t *qa;    /* [M][K] */
    const float *da;     /* [M][K / 32] (the K-quants' one scale per 256 values, 8 times) */
    const int32_t *init; /* [M][S] */
    const float *fa;     /* [M][S] */
    int64_t K, S;
};

/* One product's job: panel p is item p (pool.h). */
struct gemm_job {
    const void *w, *bias;
    void *out;
    struct gemm_rows xr;
    int64_t M, N, K, nb, o_st, panels;
    int fmt, dt, prefetch;
};

/* The weights of the chunk after panel p's chunk at k0, for the tiles to prefetch into L2
 * while they run over this one (the chunk's unpacking waited on memory otherwise, about a
 * third of the time at 9-16 rows of x): lines [from, to) of it, line i being line i % per of
 * run i / per. A run is a weight row's blocks in the chunk, or a group's (8-row layouts). */
struct gemm_pf {
    const uint8_t *base[GEMM_PANEL];
    int64_t per, from, to;
};

static inline void gemm_next_chunk(int fmt, const uint8_t *w, int64_t N, int64_t nb, int64_t p,
                                   int64_t k0, int64_t K, struct gemm_pf *pf) {
    const struct gemm_fmt fi = GEMM_FMT[fmt];
    const int rows = AE_QUANT_IS_R8(fmt) ? 8 : 1; /* rows per run */
    const int64_t run_bytes = (int64_t)fi.bytes * rows;
    if (k0 + GEMM_KC < K) k0 += GEMM_KC;
    else p++, k0 = 0;
    const int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
    int runs = 0;
    for (int64_t r = p * GEMM_PANEL / rows; r < (p + 1) * GEMM_PANEL / rows && r < N / rows; r++)
        pf->base[runs++] = w + (r * nb + k0 / fi.values) * run_bytes;
    pf->per = kc / fi.values * run_bytes / 64;
    pf->from = 0;
    pf->to = runs * pf->per;
}

/* A panel item's scratch, the thread's (linear.c's ae_thread_scratch), 64-byte aligned: u, a
 * chunk of the panel's rows unpacked (u_bytes; none for the 8-row layouts); panel, the chunk
 * in the GEMM's layout (p_bytes); sc and mn, its d_s and m_s ([GEMM_KC / sub][GEMM_PANEL]);
 * res, the sums of every row of x for the panel (m_pad rows of GEMM_PANEL); bias_row,
 * GEMM_PANEL floats. */
struct gemm_scratch {
    uint8_t *u, *panel;
    float *sc, *mn, *res, *bias_row;
};
static inline struct gemm_scratch gemm_scratch(const struct gemm_job *j, size_t u_bytes,
                                               size_t p_bytes, int64_t m_pad) {
    const int64_t kc_max = j->K < GEMM_KC ? j->K : GEMM_KC;
    const int64_t f = kc_max / GEMM_FMT[j->fmt].sub * GEMM_PANEL; /* floats of sc and of mn */
    const size_t bytes = u_bytes + p_bytes + (size_t)(2 * f + (m_pad + 1) * GEMM_PANEL) * 4;
    char *buf = (char *)ae_thread_scratch(bytes / 4 + 16);
    buf += (64 - (uintptr_t)buf % 64) % 64;
    struct gemm_scratch s;
    s.u = (uint8_t *)buf;
    s.panel = s.u + u_bytes;
    s.sc = (float *)(buf + u_bytes + p_bytes);
    s.mn = s.sc + f;
    s.res = s.mn + f;
    s.bias_row = s.res + m_pad * GEMM_PANEL;
    return s;
}

/* Weight row w (nb blocks of format fmt) unpacked: its u into u, its d_s and m_s into column
 * `col` of the panel's sc and mn ([S][GEMM_PANEL]). */
typedef void (*gemm_unpack_fn)(int fmt, const uint8_t *w, int64_t nb, uint8_t *u, float *sc,
                               float *mn, int col);

/* unpack_row_0 .. unpack_row_7 and unpack_row (a gemm_unpack_fn) over the including file's
 * unpack_block(fmt, block, u, d_s, m_s): one function per format, so that each unpack_block
 * loop is compiled (and vectorized) for its format. */
#define GEMM_UNPACK_ROW_FN(f)                                                               \
    static void unpack_row_##f(const uint8_t *restrict w, int64_t nb, uint8_t *restrict u,   \
                               float *restrict sc, float *restrict mn, int col) {           \
        const struct gemm_fmt fi = GEMM_FMT[f];                                             \
        const int subs = fi.values / fi.sub;                                                \
        float s[16], m[16];                                                                 \
        for (int64_t i = 0; i < nb; i++) {                                                  \
            unpack_block(f, w + i * fi.bytes, u + i * fi.values, s, m);                     \
            for (int t = 0; t < subs; t++) {                                                \
                sc[(i * subs + t) * GEMM_PANEL + col] = s[t];                               \
                if (fi.has_min) mn[(i * subs + t) * GEMM_PANEL + col] = m[t];               \
            }                                                                               \
        }                                                                                   \
    }
#define GEMM_UNPACK_ROWS                                                                    \
    GEMM_UNPACK_ROW_FN(0) GEMM_UNPACK_ROW_FN(1) GEMM_UNPACK_ROW_FN(2) GEMM_UNPACK_ROW_FN(3)  \
    GEMM_UNPACK_ROW_FN(4) GEMM_UNPACK_ROW_FN(5) GEMM_UNPACK_ROW_FN(6) GEMM_UNPACK_ROW_FN(7)  \
    GEMM_UNPACK_ROW_FN(13)                                                                  \
    static void unpack_row(int fmt, const uint8_t *w, int64_t nb, uint8_t *u, float *sc,     \
                           float *mn, int col) {                                            \
        static void (*const fns[8])(const uint8_t *, int64_t, uint8_t *, float *, float *,   \
                                    int) = {unpack_row_0, unpack_row_1, unpack_row_2,        \
                                            unpack_row_3, unpack_row_4, unpack_row_5,        \
                                            unpack_row_6, unpack_row_7};                     \
        if (fmt == AE_QUANT_Q5_0_BYTES) unpack_row_13(w, nb, u, sc, mn, col);               \
        else fns[fmt](w, nb, u, sc, mn, col);                                               \
    }

/* Values k0 .. k0 + kc of the panel's weight rows n0 .. n0 + cols - 1 (the file layouts),
 * row c's u at u + c * kc and its d_s / m_s in column c of sc / mn; rows from cols to
 * GEMM_PANEL zero (weights past N). */
static inline void gemm_unpack_chunk(gemm_unpack_fn unpack, const struct gemm_job *j, int64_t n0,
                                     int64_t cols, int64_t k0, int64_t kc, uint8_t *u,
                                     float *sc, float *mn) {
    const struct gemm_fmt fi = GEMM_FMT[j->fmt];
    const int64_t row_bytes = j->nb * fi.bytes, subs = kc / fi.sub;
    const uint8_t *w = (const uint8_t *)j->w + n0 * row_bytes + k0 / fi.values * fi.bytes;
    for (int c = 0; c < GEMM_PANEL; c++) {
        if (c < cols) {
            unpack(j->fmt, w + c * row_bytes, kc / fi.values, u + c * kc, sc, mn, c);
            continue;
        }
        memset(u + c * kc, 0, (size_t)kc);
        for (int64_t t = 0; t < subs; t++) sc[t * GEMM_PANEL + c] = mn[t * GEMM_PANEL + c] = 0;
    }
}

#ifdef HAVE_GEMM_AVX2
#include <immintrin.h>
/* The fp16 scale at p (a block's d or m), widened: for the AVX2 files (F16C). */
static inline float gemm_f16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}
#endif

/* Panel p of the job on AVX2 (quant_gemm_avx2.c): an ae_pool_fn. Formats 0-7 and 13 only. */
void ae_gemm_panel_avx2(const void *ctx, int64_t p, const struct ae_commit *commit);

/* ae_quant_gemm's Q8_0 product on AVX2 in fp32 (quant_gemm_f32.c), which it runs from
 * AE_GEMM_F32_ROWS rows once it has checked the shape (K a positive multiple of 32, M and N
 * positive): the same arguments and returns, x's values as they are. Below, the
 * dequantizing per row cost more than the FMAs gained (2 threads of Zen 1, 2048 x 2048: 16.0
 * multiply-adds per ns against the integer GEMM's 22.8 at 10 rows, 25.9 against 24.1 at 16). */
#define AE_GEMM_F32_ROWS 16
int ae_quant_gemm_f32(const void *x, int dt, int64_t x_st, int64_t M, const void *w, int64_t N,
                      int64_t K, const void *bias, void *out, int64_t o_st, int num_threads);

#endif
