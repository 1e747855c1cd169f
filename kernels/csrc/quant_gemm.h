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

#include "ae_kernels.h"
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

static inline void gemm_next_chunk(int fmt, const uint8_t *w, int64_t N, int64_t nb, int64_t p, int64_t k0,
                       int64_t K, struct gemm_pf *pf) {
    const struct gemm_fmt fi = GEMM_FMT[fmt];
    const int rows = fmt >= AE_QUANT_Q4_K_R8 ? 8 : 1; /* rows per run */
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

/* Panel p of the job on AVX2 (quant_gemm_avx2.c): an ae_pool_fn. Formats 0-7 only. */
void ae_gemm_panel_avx2(const void *ctx, int64_t p, const struct ae_commit *commit);

#endif
