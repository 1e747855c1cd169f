/*
 * bf16 linear layers over plain row-major weights, for CPUs without AVX512-BF16:
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and out bf16 (rows with their own stride).
 *
 * Why: on an AVX2 CPU (AMD Zen 2/3, Intel before Cooper Lake) oneDNN has no bf16 path, and
 * torch's fallback bf16 GEMM runs at a sixth of its fp32 speed (16 against 106 GFLOP/s for 64
 * rows of SmolLM2's MLP on 2 Zen 3 cores): a bf16 model served 29 tok/s where llama.cpp
 * served 140. Widening bf16 to fp32 is one shift, so this kernel keeps the weights in bf16 (half
 * the bytes of fp32: decode reads every weight once per step) and does the arithmetic in fp32
 * with FMAs, as llama.cpp's bf16 path does on such CPUs.
 *
 * Shape of the work: x is widened once into an fp32 scratch (M x K floats); the output columns
 * are split between the threads. Rows are taken in panels of about 24 KB of fp32, which stay in
 * L1; for each panel a thread walks its columns in pairs, and each pair serves all the panel's
 * rows in blocks of 4 (the pair is read once per panel: from memory for the first, from L2 or
 * L3 after). Panels the size of L2 made every weight pair stream the panel from L2, which
 * bounded the FMAs: 64-row products ran ~25% slower on Zen 3. One row (decode) takes four
 * columns at a time instead, which keeps four weight streams in flight.
 *
 * Since gemm_dense.c, this kernel takes one row and 4 or 8; ae_linear_bf16_dense sends every
 * other row count there.
 *
 * Arithmetic: products and sums in fp32 (each output's sum in 8 interleaved partial sums, then
 * added), the bias added in fp32, one rounding to bf16 (nearest even) at the store.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AE_DENSE_SIMD 1
#else
#define AE_DENSE_SIMD 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "ae_kernels.h"
#include "bf16.h"

#define ROW_BLOCK 4               /* rows sharing each weight load */
#define PANEL_BYTES (24 * 1024)  /* x rows per panel: this many bytes of fp32, kept in L1 */

#if AE_DENSE_SIMD
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sums[r][j] = x row r . weight row j, for R rows (R <= ROW_BLOCK) and J weight rows. */
static inline void dot_block(const float *x, int64_t ldx, int R, const uint16_t *w, int64_t ldw,
                             int J, int64_t K, float sums[ROW_BLOCK][4]) {
    int64_t k = 0;
#if AE_DENSE_SIMD
    if (J == 2 && R == ROW_BLOCK) { /* the hot case of batched steps: 8 accumulators */
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
        __m256 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        for (; k + 8 <= K; k += 8) {
            /* the next pair of weight rows (contiguous after these), as far along as we are:
             * the first row block streams the pair from memory, the others find it in L1 */
            __builtin_prefetch(w + 2 * ldw + 2 * k, 0, 0);
            __m256 w0 = load8_bf16(w + k), w1 = load8_bf16(w + ldw + k);
            __m256 xv = _mm256_loadu_ps(x + k);
            a00 = _mm256_fmadd_ps(xv, w0, a00);
            a01 = _mm256_fmadd_ps(xv, w1, a01);
            xv = _mm256_loadu_ps(x + ldx + k);
            a10 = _mm256_fmadd_ps(xv, w0, a10);
            a11 = _mm256_fmadd_ps(xv, w1, a11);
            xv = _mm256_loadu_ps(x + 2 * ldx + k);
            a20 = _mm256_fmadd_ps(xv, w0, a20);
            a21 = _mm256_fmadd_ps(xv, w1, a21);
            xv = _mm256_loadu_ps(x + 3 * ldx + k);
            a30 = _mm256_fmadd_ps(xv, w0, a30);
            a31 = _mm256_fmadd_ps(xv, w1, a31);
        }
        sums[0][0] = hsum8(a00), sums[0][1] = hsum8(a01);
        sums[1][0] = hsum8(a10), sums[1][1] = hsum8(a11);
        sums[2][0] = hsum8(a20), sums[2][1] = hsum8(a21);
        sums[3][0] = hsum8(a30), sums[3][1] = hsum8(a31);
    } else if (J == 4 && R == 1) { /* one row (decode): four weight streams, two sums each */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const uint16_t *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
        for (; k + 16 <= K; k += 16) {
            /* the next group of four rows (contiguous after these), as far along as we are */
            __builtin_prefetch(w0 + 4 * ldw + 4 * k, 0, 0);
            __builtin_prefetch(w0 + 4 * ldw + 4 * k + 32, 0, 0);
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            a0 = _mm256_fmadd_ps(x0, load8_bf16(w0 + k), a0);
            a1 = _mm256_fmadd_ps(x0, load8_bf16(w1 + k), a1);
            a2 = _mm256_fmadd_ps(x0, load8_bf16(w2 + k), a2);
            a3 = _mm256_fmadd_ps(x0, load8_bf16(w3 + k), a3);
            b0 = _mm256_fmadd_ps(x1, load8_bf16(w0 + k + 8), b0);
            b1 = _mm256_fmadd_ps(x1, load8_bf16(w1 + k + 8), b1);
            b2 = _mm256_fmadd_ps(x1, load8_bf16(w2 + k + 8), b2);
            b3 = _mm256_fmadd_ps(x1, load8_bf16(w3 + k + 8), b3);
        }
        for (; k + 8 <= K; k += 8) {
            __m256 x0 = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(x0, load8_bf16(w0 + k), a0);
            a1 = _mm256_fmadd_ps(x0, load8_bf16(w1 + k), a1);
            a2 = _mm256_fmadd_ps(x0, load8_bf16(w2 + k), a2);
            a3 = _mm256_fmadd_ps(x0, load8_bf16(w3 + k), a3);
        }
        sums[0][0] = hsum8(_mm256_add_ps(a0, b0)), sums[0][1] = hsum8(_mm256_add_ps(a1, b1));
        sums[0][2] = hsum8(_mm256_add_ps(a2, b2)), sums[0][3] = hsum8(_mm256_add_ps(a3, b3));
    } else {
        __m256 acc[ROW_BLOCK][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            __m256 wv[4];
            for (int j = 0; j < J; j++) wv[j] = load8_bf16(w + j * ldw + k);
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
                for (int j = 0; j < J; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) sums[r][j] = hsum8(acc[r][j]);
    }
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) sums[r][j] = 0.0f;
#endif
    for (; k < K; k++) /* the tail (K not a multiple of 8), and the whole sum without SIMD */
        for (int j = 0; j < J; j++) {
            float wk = bf16_to_f32(w[j * ldw + k]);
            for (int r = 0; r < R; r++) sums[r][j] += x[r * ldx + k] * wk;
        }
}

/* Output columns [n0, n1) of every row: pairs (or fours, for one row) of weight rows at a time,
 * rows in panels that stay in L1, ROW_BLOCK rows per weight load. */
static void columns(const float *xf, int64_t M, const uint16_t *w, int64_t K, const uint16_t *bias,
                    uint16_t *out, int64_t ldo, int64_t n0, int64_t n1) {
    int64_t panel = PANEL_BYTES / (K * (int64_t)sizeof(float));
    panel = panel < ROW_BLOCK ? ROW_BLOCK : panel - panel % ROW_BLOCK;
    const int step = M == 1 ? 4 : 2;
    float sums[ROW_BLOCK][4];
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
        int64_t m1 = m0 + panel < M ? m0 + panel : M;
        for (int64_t n = n0; n < n1; n += step) {
            int J = n1 - n < step ? (int)(n1 - n) : step;
            for (int64_t m = m0; m < m1; m += ROW_BLOCK) {
                int R = m1 - m < ROW_BLOCK ? (int)(m1 - m) : ROW_BLOCK;
                dot_block(xf + m * K, K, R, w + n * K, K, J, K, sums);
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < J; j++) {
                        float v = sums[r][j] + (bias ? bf16_to_f32(bias[n + j]) : 0.0f);
                        out[(m + r) * ldo + n + j] = f32_to_bf16(v);
                    }
            }
        }
    }
}

int ae_linear_dense_simd(void) { return AE_DENSE_SIMD; }

int ae_linear_bf16_dense(const void *x_, int64_t ldx, int64_t M, const void *w_, int64_t N,
                         int64_t K, const void *bias_, void *out_, int64_t ldo, int threads) {
    const uint16_t *x = (const uint16_t *)x_, *w = (const uint16_t *)w_;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *out = (uint16_t *)out_;
    if (M <= 0 || N <= 0) return 0;
    /* Here one row (decode: four weight streams) and whole 4-row blocks of up to 8 rows, where
     * packing the weights for the GEMM does not pay; every other count runs faster there, at
     * 12 rows or more by 1.1-1.5x (gemm_dense.c). */
    if (M != 1 && M != 4 && M != 8)
        return ae_gemm_bf16_dense(x_, ldx, M, w_, N, K, bias_, out_, ldo, threads);
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -1;
    if (threads < 1) threads = 1;
    /* Each thread gets a run of whole column groups (4 for one row, else 2), so groups stay
     * whole and every thread streams its own part of W once. */
    const int64_t group = M == 1 ? 4 : 2;
    const int64_t groups = (N + group - 1) / group;
    if (groups < threads) threads = (int)groups;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        widen_rows(x, ldx, M, K, xf); /* every row, before any thread reads one */
        int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        int64_t n0 = g0 * group, n1 = g1 * group < N ? g1 * group : N;
        if (n0 < n1) columns(xf, M, w, K, bias, out, ldo, n0, n1);
    }
    free(xf);
    return 0;
}
