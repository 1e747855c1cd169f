/*
 * Greedy decoding's next token without the lm_head's logits: the argmax of x @ W^T + bias
 * (bf16, first index on ties), found by reading an int8 copy of W (half the bytes) and
 * computing exactly only the 64-column blocks of W that may hold the maximum.
 *
 * Why: at one to a few rows the lm_head is a matrix-vector product bound by memory, and a
 * small model's is a large share of a decode step (SmolLM2-135M: 57 of 270 MB a token;
 * Qwen2.5-0.5B's 152k vocabulary: 272 of ~1,000 MB). Greedy sampling needs one index per row.
 *
 * How, per row h (K values, bf16) and column n (the int8 copy: q[n][k] = round(W[n][k] / s[n]),
 * s[n] = max_k |W[n][k]| / 127, rn[n] >= ||W[n] - s[n] q[n]||_2, both built by
 * kernels/lm_head_argmax_cpu.py):
 *
 *   a[n] = s[n] * sum_k h[k] q[n][k] (+ bias[n])                       the screen, in fp32
 *   |exact[n] - a[n]| <= min(||h||_2 rn[n], ||h||_1 s[n] / 2)         Cauchy-Schwarz, and
 *                        + 2 gamma_K ||h||_1 127 s[n]                  |W - s q| <= s / 2;
 *                        + rounding slack                              fp32 sums of K terms
 *
 * where exact[n] is the fp32 sum the product computes (ae_block_sums) plus bias, before its
 * rounding to bf16. With lo/hi = a -/+ that bound, L = max_n lo[n] is at most the largest
 * exact value, so the maximum's bf16 value is at least bf16(L), and a column can round to it
 * only if its exact value is at least L - |L| 2^-7 (a bf16 ulp at most, each side). Every
 * block holding a column with hi >= that threshold is computed exactly by the product's own
 * block kernel, rounded to bf16 as the product stores it, and the first largest value wins:
 * the same index as argmax over ae_linear_bf16's logits, bit for bit, never an estimate.
 * On SmolLM2 one or two blocks per row qualify (median), on random 0.5B weights about six.
 *
 * The int8 copy lies as [blocks][K][64] (block b's columns b*64.. side by side for each k):
 * one 64-byte line per k, widened to fp32 for FMAs against h (exact for int8 values).
 */

#include <float.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "ae_kernels.h"
#include "linear.h"
#include "pool.h"

#define BLOCK AE_LINEAR_BLOCK
#define SCREEN_ROWS 4           /* rows per pass over an int8 block: 4 x 4 fp32 sums */
#define SCREEN_PREFETCH 4096    /* bytes ahead of the loads (see linear.c's PREFETCH_BYTES) */
#define GROUP AE_POOL_MAX_ROWS  /* rows screened together (a call takes any number) */

/* acc[r][0..63] = sum_k h[r][k] * q[k][c] for R rows of h (row stride ldh) and one int8
 * block qb ([K][64]). The first pass streams the block from memory, later ones from L2. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void screen_pass(const int8_t *qb, int64_t K,
                                                              const float *h, int64_t ldh,
                                                              float *acc, const int R,
                                                              int prefetch) {
    /* Two sets of sums, even and odd k, so that each FMA waits for the one two k back. */
    __m512 a[SCREEN_ROWS][2][4];
    for (int r = 0; r < R; r++)
        for (int e = 0; e < 2; e++)
            for (int i = 0; i < 4; i++) a[r][e][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        const int8_t *line = qb + k * BLOCK;
        if (prefetch) {
            __builtin_prefetch(line + SCREEN_PREFETCH, 0, 2);
            __builtin_prefetch(line + BLOCK + SCREEN_PREFETCH, 0, 2);
        }
        for (int e = 0; e < 2; e++) {
            __m512 w[4];
            for (int i = 0; i < 4; i++)
                w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(line + e * BLOCK + 16 * i))));
            for (int r = 0; r < R; r++) {
                const __m512 hk = _mm512_set1_ps(h[r * ldh + k + e]);
                for (int i = 0; i < 4; i++) a[r][e][i] = _mm512_fmadd_ps(w[i], hk, a[r][e][i]);
            }
        }
    }
    for (; k < K; k++) {
        const int8_t *line = qb + k * BLOCK;
        for (int i = 0; i < 4; i++) {
            const __m512 w = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(line + 16 * i))));
            for (int r = 0; r < R; r++)
                a[r][0][i] = _mm512_fmadd_ps(w, _mm512_set1_ps(h[r * ldh + k]), a[r][0][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(acc + r * BLOCK + 16 * i, _mm512_add_ps(a[r][0][i], a[r][1][i]));
}
#else
static inline void screen_pass(const int8_t *qb, int64_t K, const float *h, int64_t ldh,
                               float *acc, const int R, int prefetch) {
    (void)prefetch;
    for (int r = 0; r < R; r++) {
        float a[BLOCK] = {0};
        for (int64_t k = 0; k < K; k++) {
            const float hk = h[r * ldh + k];
            const int8_t *line = qb + k * BLOCK;
            for (int c = 0; c < BLOCK; c++) a[c] += hk * (float)line[c];
        }
        memcpy(acc + r * BLOCK, a, sizeof a);
    }
}
#endif

static void screen_block(const int8_t *qb, int64_t K, const float *h, int64_t ldh, int64_t M,
                         float *acc) {
    for (int64_t r0 = 0; r0 < M; r0 += SCREEN_ROWS) {
        const int64_t rows = M - r0 < SCREEN_ROWS ? M - r0 : SCREEN_ROWS;
        const float *hr = h + r0 * ldh;
        float *ar = acc + r0 * BLOCK;
        const int first = r0 == 0;
        if (rows == 4) screen_pass(qb, K, hr, ldh, ar, 4, first);
        else if (rows == 3) screen_pass(qb, K, hr, ldh, ar, 3, first);
        else if (rows == 2) screen_pass(qb, K, hr, ldh, ar, 2, first);
        else screen_pass(qb, K, hr, ldh, ar, 1, first);
    }
}

/* The screen on the pool: item i is `per_item` consecutive blocks; per row and block, the
 * largest lo and hi of its columns below `vocab` (NaN lo: a value that is not finite). */
struct screen_job {
    const float *h; /* [M][K] fp32 */
    const int8_t *q;
    const float *scale, *rnorm;
    const void *bias;
    const float *noise; /* [M][vocab] Gumbel noise of the sampled rows (the pool's copy) */
    float *blk_lo, *blk_hi; /* [M][blocks], written on commit */
    int64_t M, K, vocab, blocks, per_item;
    float coef[GROUP][3]; /* per row: ||h||_2, ||h||_1 / 2, 2 gamma_K 127 ||h||_1 */
    float temp[GROUP];    /* per row: 0 greedy, else the temperature of its sample */
};

/* A column's interval [lo, hi]: for a greedy row, of its exact fp32 value (see the top); for
 * a sampled row, of its score bf16(exact) / T + g, widened by the bf16 rounding (2^-8
 * relative) and by the two fp32 roundings of the score. Scalar and 16-lane forms. */
static inline void column_interval(float acc, float s, float rn, float bias, const float *c,
                                   float t, float g, float *lo, float *hi) {
    const float a = acc * s + bias;
    float e = fminf(c[0] * rn, c[1] * s) + c[2] * s;
    e = e * (1.0f + 0x1p-16f) + 0x1p-20f * fabsf(a) + 1e-30f; /* a's and e's own rounding */
    if (t == 0.0f) {
        *lo = a - e, *hi = a + e;
        return;
    }
    const float it = 1.0f / t, wide = e + (fabsf(a) + e) * 0x1p-8f;
    const float slack = 0x1p-20f * ((fabsf(a) + wide) * it + fabsf(g)) + 1e-30f;
    *lo = (a - wide) * it + g - slack, *hi = (a + wide) * it + g + slack;
}

#ifdef __AVX512F__
static inline void column_interval16(__m512 acc, __m512 s, __m512 rn, __m512 bias,
                                     const float *c, float t, __m512 g, __m512 *lo,
                                     __m512 *hi, __m512 *mag) {
    const __m512 a = _mm512_fmadd_ps(acc, s, bias), abs_a = _mm512_abs_ps(a);
    __m512 e = _mm512_min_ps(_mm512_mul_ps(_mm512_set1_ps(c[0]), rn),
                             _mm512_mul_ps(_mm512_set1_ps(c[1]), s));
    e = _mm512_fmadd_ps(_mm512_set1_ps(c[2]), s, e);
    e = _mm512_add_ps(_mm512_fmadd_ps(e, _mm512_set1_ps(1.0f + 0x1p-16f),
                                      _mm512_mul_ps(abs_a, _mm512_set1_ps(0x1p-20f))),
                      _mm512_set1_ps(1e-30f));
    *mag = _mm512_max_ps(abs_a, e);
    if (t == 0.0f) {
        *lo = _mm512_sub_ps(a, e), *hi = _mm512_add_ps(a, e);
        return;
    }
    const __m512 it = _mm512_set1_ps(1.0f / t);
    const __m512 wide = _mm512_fmadd_ps(_mm512_add_ps(abs_a, e), _mm512_set1_ps(0x1p-8f), e);
    const __m512 slack = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_add_ps(abs_a, wide), it, _mm512_abs_ps(g)),
        _mm512_set1_ps(0x1p-20f), _mm512_set1_ps(1e-30f));
    *lo = _mm512_sub_ps(_mm512_fmadd_ps(_mm512_sub_ps(a, wide), it, g), slack);
    *hi = _mm512_add_ps(_mm512_fmadd_ps(_mm512_add_ps(a, wide), it, g), slack);
}
#endif

/* The largest lo and hi over columns n0 .. n0 + cols of row r (acc: the row's 64 int8 sums);
 * 0 where a value is not finite. */
static int column_bounds(const float *acc, const struct screen_job *j, int64_t r, int64_t n0,
                         int64_t cols, float *max_lo, float *max_hi) {
    const float *c = j->coef[r], t = j->temp[r];
    const float *g = t == 0.0f ? NULL : j->noise + r * j->vocab;
    const uint16_t *bias = j->bias;
    int64_t i = 0;
    int finite = 1;
    float mlo = -INFINITY, mhi = -INFINITY;
#ifdef __AVX512F__
    if (cols == BLOCK) {
        const __m512 big = _mm512_set1_ps(FLT_MAX);
        __m512 vlo = _mm512_set1_ps(-INFINITY), vhi = vlo;
        __mmask16 ok = 0xffff;
        for (; i < BLOCK; i += 16) {
            const int64_t n = n0 + i;
            __m512 b = _mm512_setzero_ps();
            if (bias) {
                const __m256i b16 = _mm256_loadu_si256((const __m256i *)(bias + n));
                b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16));
            }
            const __m512 gv = g ? _mm512_loadu_ps(g + n) : _mm512_setzero_ps();
            __m512 lo, hi, mag;
            column_interval16(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(j->scale + n),
                              _mm512_loadu_ps(j->rnorm + n), b, c, t, gv, &lo, &hi, &mag);
            ok &= _mm512_cmp_ps_mask(mag, big, _CMP_LE_OQ); /* NaN compares false */
            vlo = _mm512_max_ps(vlo, lo);
            vhi = _mm512_max_ps(vhi, hi);
        }
        mlo = _mm512_reduce_max_ps(vlo);
        mhi = _mm512_reduce_max_ps(vhi);
        finite = ok == 0xffff;
    }
#endif
    for (; i < cols; i++) {
        const int64_t n = n0 + i;
        float lo, hi;
        column_interval(acc[i], j->scale[n], j->rnorm[n], bias ? bf16_to_f32(bias[n]) : 0.0f,
                        c, t, g ? g[n] : 0.0f, &lo, &hi);
        finite &= fabsf(lo) <= FLT_MAX && fabsf(hi) <= FLT_MAX;
        mlo = fmaxf(mlo, lo);
        mhi = fmaxf(mhi, hi);
    }
    *max_lo = mlo, *max_hi = mhi;
    return finite;
}

static void screen_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct screen_job *j = ctx;
    const int64_t M = j->M, b0 = item * j->per_item;
    const int64_t b1 = b0 + j->per_item < j->blocks ? b0 + j->per_item : j->blocks;
    const int64_t nb = b1 - b0;
    float *acc = ae_thread_scratch((size_t)(M * BLOCK + 2 * M * nb));
    float *lo = acc + M * BLOCK, *hi = lo + M * nb;
    for (int64_t b = b0; b < b1; b++) {
        screen_block(j->q + b * j->K * BLOCK, j->K, j->h, j->K, M, acc);
        const int64_t n0 = b * BLOCK;
        const int64_t cols = j->vocab - n0 < BLOCK ? j->vocab - n0 : BLOCK;
        for (int64_t r = 0; r < M; r++) {
            float max_lo, max_hi;
            const int finite = column_bounds(acc + r * BLOCK, j, r, n0, cols, &max_lo, &max_hi);
            lo[r * nb + (b - b0)] = finite ? max_lo : NAN;
            hi[r * nb + (b - b0)] = max_hi;
        }
    }
    if (!ae_commit_begin(commit)) return;
    for (int64_t r = 0; r < M; r++) {
        memcpy(j->blk_lo + r * j->blocks + b0, lo + r * nb, (size_t)nb * sizeof(float));
        memcpy(j->blk_hi + r * j->blocks + b0, hi + r * nb, (size_t)nb * sizeof(float));
    }
    ae_commit_end(commit);
}

/* The exact pass on the pool: item i is `per_item` consecutive (row, block) pairs, each the
 * product's 64 fp32 column sums for that row and block. */
struct exact_job {
    const uint32_t *xp; /* [M][P] the rows as k-pairs */
    const void *w;
    const int32_t *pairs; /* [n][2] (row, block), in a reused buffer: checked before use */
    float *out;           /* [n][64], written on commit */
    int64_t P, M, blocks, n, per_item;
};

static void exact_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct exact_job *j = ctx;
    const int64_t p0 = item * j->per_item;
    const int64_t p1 = p0 + j->per_item < j->n ? p0 + j->per_item : j->n;
    const int64_t block_bytes = j->P * 2 * BLOCK * 2;
    float *res = ae_thread_scratch((size_t)((p1 - p0) * BLOCK));
    for (int64_t p = p0; p < p1; p++) {
        /* Read once: a helper preempted in here may run on while the next call rewrites the
         * pairs; a value out of range then must not become an address. */
        const int32_t row = ((const volatile int32_t *)j->pairs)[2 * p];
        const int32_t blk = ((const volatile int32_t *)j->pairs)[2 * p + 1];
        if (row < 0 || row >= j->M || blk < 0 || blk >= j->blocks) {
            memset(res + (p - p0) * BLOCK, 0, BLOCK * sizeof(float)); /* its commit fails */
            continue;
        }
        ae_block_sums((const char *)j->w + blk * block_bytes, j->P, j->xp + row * j->P, 1,
                      res + (p - p0) * BLOCK);
    }
    if (!ae_commit_begin(commit)) return;
    memcpy(j->out + p0 * BLOCK, res, (size_t)((p1 - p0) * BLOCK) * sizeof(float));
    ae_commit_end(commit);
}

/* ceil(n / AE_POOL_MAX_ITEMS): units per item, so that a job has at most that many items. */
static int64_t per_item_for(int64_t n) {
    return n <= AE_POOL_MAX_ITEMS ? 1 : (n + AE_POOL_MAX_ITEMS - 1) / AE_POOL_MAX_ITEMS;
}

static void *buffer(int pooled, int slot, size_t bytes) {
    void *p = pooled ? ae_pool_buffer(slot, bytes) : malloc(bytes);
    if (p == NULL) abort(); /* at most a few MB: no way on without it */
    return p;
}

/* Up to GROUP rows: see ae_lm_head_argmax_bf16. */
static int64_t argmax_group(const void *x, int64_t x_st, int64_t M, const int8_t *q,
                            const float *scale, const float *rnorm, const void *w, int64_t K,
                            int64_t Kp, const void *bias, int64_t vocab, const float *temps,
                            const float *noise, int64_t noise_st, int64_t *out,
                            int num_threads) {
    const int64_t P = Kp / 2, blocks = (vocab + BLOCK - 1) / BLOCK;
    const double gamma = (double)K * 0x1p-24 / (1.0 - (double)K * 0x1p-24);
    struct screen_job sj = {0};
    int bad[GROUP] = {0}, sampled = 0;
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = (const uint16_t *)x + r * x_st;
        double l1 = 0.0, l2 = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const double v = bf16_to_f32(row[k]);
            l1 += fabs(v);
            l2 += v * v;
        }
        l2 = sqrt(l2);
        bad[r] = !(l1 <= 1e30); /* NaN or infinite values, or logits that may overflow */
        /* Rounded up: the norms' own rounding, and their conversion to float. */
        sj.coef[r][0] = (float)(l2 * (1.0 + 1e-6));
        sj.coef[r][1] = (float)(l1 * 0.5 * (1.0 + 1e-6));
        sj.coef[r][2] = (float)(2.0 * gamma * 127.0 * l1 * 1.001);
        if (bad[r]) sj.coef[r][0] = sj.coef[r][1] = sj.coef[r][2] = 0.0f;
        sj.temp[r] = temps && noise ? temps[r] : 0.0f;
        sampled |= sj.temp[r] != 0.0f;
    }

    const int pooled = ae_linear_use_pool(M, num_threads);
    uint32_t *xp = ae_rows_as_pairs(pooled, x, x_st, M, K, P);
    /* Slot 1: the rows in fp32, the blocks' lo and hi, and a copy of the noise (the caller's
     * memory may be gone while a preempted helper still reads it). */
    const int64_t noise_floats = sampled ? M * vocab : 0;
    float *h = buffer(pooled, 1, (size_t)(M * K + 2 * M * blocks + noise_floats) * sizeof(float));
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < K; k++)
            h[r * K + k] = bad[r] ? 0.0f : bf16_to_f32(((const uint16_t *)x)[r * x_st + k]);
    sj.h = h, sj.q = q, sj.scale = scale, sj.rnorm = rnorm, sj.bias = bias;
    sj.blk_lo = h + M * K, sj.blk_hi = sj.blk_lo + M * blocks;
    if (sampled) {
        float *copy = sj.blk_hi + M * blocks;
        for (int64_t r = 0; r < M; r++)
            if (sj.temp[r] != 0.0f)
                memcpy(copy + r * vocab, noise + r * noise_st, (size_t)vocab * sizeof(float));
        sj.noise = copy;
    }
    sj.M = M, sj.K = K, sj.vocab = vocab, sj.blocks = blocks, sj.per_item = per_item_for(blocks);
    ae_linear_run_items(pooled, screen_item, &sj, sizeof sj,
                        (blocks + sj.per_item - 1) / sj.per_item, num_threads);

    /* Per row: the threshold, and the blocks that reach it. */
    int32_t *pairs = buffer(pooled, 2, (size_t)(2 * M * blocks) * sizeof(int32_t));
    int64_t n = 0;
    for (int64_t r = 0; r < M; r++) {
        const float *lo = sj.blk_lo + r * blocks, *hi = sj.blk_hi + r * blocks;
        float L = -INFINITY;
        for (int64_t b = 0; b < blocks && !bad[r]; b++) {
            if (isnan(lo[b])) bad[r] = 1;
            L = fmaxf(L, lo[b]);
        }
        if (bad[r] || !(fabsf(L) <= FLT_MAX)) {
            bad[r] = 1;
            continue;
        }
        /* A greedy row's maximum may round to bf16(L): a bf16 ulp below L may tie it. A
         * sampled row's intervals hold its scores, bf16 rounding included. */
        const float threshold =
            sj.temp[r] == 0.0f ? L - fabsf(L) * (0x1p-7f * 1.02f) - 1e-30f : L;
        for (int64_t b = 0; b < blocks; b++)
            if (hi[b] >= threshold) {
                pairs[2 * n] = (int32_t)r;
                pairs[2 * n + 1] = (int32_t)b;
                n++;
            }
    }

    /* The exact sums of those blocks (the pairs stay in slot 2, the sums go after them). */
    float *exact = NULL;
    if (n > 0) {
        const size_t bytes = (size_t)n * (2 * sizeof(int32_t) + BLOCK * sizeof(float));
        int32_t *all = buffer(pooled, 2, bytes);
        if (all != pairs) { /* the pool's buffer grew: a new one, without the pairs */
            memcpy(all, pairs, (size_t)n * 2 * sizeof(int32_t));
            if (!pooled) free(pairs);
            pairs = all;
        }
        exact = (float *)(pairs + 2 * n);
        const struct exact_job ej = {xp, w, pairs, exact, P, M, blocks, n, per_item_for(n)};
        ae_linear_run_items(pooled, exact_item, &ej, sizeof ej,
                            (n + ej.per_item - 1) / ej.per_item, num_threads);
    }

    /* Per row, the first largest of its blocks' values as the product would store them (a
     * sampled row: of value / T + g, in fp32 as the sampler computes it). */
    for (int64_t r = 0; r < M; r++) out[r] = -1;
    float best[GROUP];
    for (int64_t r = 0; r < M; r++) best[r] = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        const int64_t r = pairs[2 * p], n0 = (int64_t)pairs[2 * p + 1] * BLOCK;
        const int64_t cols = vocab - n0 < BLOCK ? vocab - n0 : BLOCK;
        for (int64_t c = 0; c < cols && !bad[r]; c++) {
            float v = ae_product_value(exact + p * BLOCK + c, bias, n0 + c);
            if (sj.temp[r] != 0.0f) v = v / sj.temp[r] + sj.noise[r * vocab + n0 + c];
            if (isnan(v)) bad[r] = 1;
            else if (v > best[r]) best[r] = v, out[r] = n0 + c;
        }
    }
    for (int64_t r = 0; r < M; r++)
        if (bad[r]) out[r] = -1;
    if (pooled) ae_pool_release();
    else free(xp), free(h), free(pairs);
    return n;
}

/*
 * out[m] = the first index of the largest of the first `vocab` values of row m of the product
 * x @ W^T + bias as ae_linear_bf16 stores it (bf16), for m < M; -1 for a row whose values
 * could not be bounded (a NaN or infinity in the row, or among its logits): the caller then
 * computes that row's logits in full. With `temps` and `noise`, a row m with temps[m] > 0
 * takes the first largest of value / temps[m] + noise[m][n] instead (fp32, in that order: the
 * sampler's Gumbel-max, sampler.py), noise rows of stride noise_st.
 * x: [M][K] bf16, row stride x_st; q, scale, rnorm: the int8 copy of W (see the top; at least
 * ceil(vocab / 64) blocks); w: W packed as ae_linear_bf16 reads it (Kp its packed k extent);
 * bias: N bf16 values or NULL; vocab <= N. Returns how many 64-column blocks (summed over the
 * rows) it computed exactly.
 */
int64_t ae_lm_head_argmax_bf16(const void *x, int64_t x_st, int64_t M, const int8_t *q,
                               const float *scale, const float *rnorm, const void *w, int64_t K,
                               int64_t Kp, const void *bias, int64_t vocab, const float *temps,
                               const float *noise, int64_t noise_st, int64_t *out,
                               int num_threads) {
    int64_t exact = 0;
    for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
        const int64_t rows = M - m0 < GROUP ? M - m0 : GROUP;
        exact += argmax_group((const uint16_t *)x + m0 * x_st, x_st, rows, q, scale, rnorm, w,
                              K, Kp, bias, vocab, temps ? temps + m0 : NULL,
                              noise ? noise + m0 * noise_st : NULL, noise_st, out + m0,
                              num_threads);
    }
    return exact;
}

/*
 * The int8 copy of W that the screen reads, from W packed as ae_linear_bf16 reads it ([blocks]
 * [Kp / 2][64][2] bf16, N rows): per row n, scale[n] = max_k |W[n][k]| / 127 (1 for a row of
 * zeros, and for the padding rows up to blocks * 64), q[b][k][c] = round(W[n][k] / scale[n])
 * (n = b * 64 + c; half to even), and rnorm[n] >= ||W[n] - scale[n] q[n]||_2, rounded up. In
 * double, where W, scale, scale * q and their difference are exact, so |W - scale q| <=
 * scale / 2 elementwise, as the screen's bound assumes. Parallel over blocks.
 */
void ae_lm_head_quantize(const void *w, int64_t N, int64_t K, int64_t Kp, int8_t *q, float *scale,
                         float *rnorm, int num_threads) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    const uint16_t *wv = w;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *wb = wv + b * Kp * BLOCK;
        int8_t *qb = q + b * K * BLOCK;
        for (int64_t c = 0; c < BLOCK; c++) {
            const int64_t n = b * BLOCK + c;
            /* W[n][k] sits at wb[(k / 2) * 128 + c * 2 + k % 2]; a padding row is zeros */
#define W_NK(k) (n < N ? (double)bf16_to_f32(wb[((k) >> 1) * 2 * BLOCK + c * 2 + ((k) & 1)]) : 0.0)
            double amax = 0.0;
            for (int64_t k = 0; k < K; k++) amax = fmax(amax, fabs(W_NK(k)));
            const float sf = amax > 0.0 ? (float)(amax / 127.0) : 1.0f;
            const double sd = sf;
            double sq = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const double v = W_NK(k);
                double qv = nearbyint(v / sd);
                qv = qv > 127.0 ? 127.0 : qv < -127.0 ? -127.0 : qv;
                const double r = v - sd * qv;
                sq += r * r;
                qb[k * BLOCK + c] = (int8_t)qv;
            }
            const double norm = sqrt(sq) * (1.0 + 1e-12);
            float rn = (float)norm;
            if ((double)rn < norm) rn = nextafterf(rn, INFINITY);
            scale[n] = sf;
            rnorm[n] = rn;
#undef W_NK
        }
    }
}
