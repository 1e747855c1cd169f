/*
 * bf16 linear layers for CPUs with AVX2 and FMA but no AVX512-BF16, over weights packed once at
 * load time: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and out bf16 (rows with their own
 * stride), W given as ae_dense_panels (below) of kernels/linear_dense_cpu.py's pack_dense.
 *
 * Why: on an AVX2 CPU (AMD Zen 2/3, Intel before Cooper Lake) oneDNN has no bf16 path, and
 * torch's fallback bf16 GEMM runs at a sixth of its fp32 speed. These kernels keep the weights
 * in bf16 (half the bytes of fp32: a decode step reads every weight once), widen them in
 * registers and multiply with fp32 FMAs, as llama.cpp's bf16 path does on such CPUs.
 *
 * The packed layout: the weight rows in panels of 16 (the last padded with zero rows), each
 * panel k-major: for k = 0..K-1, the 16 rows' weights at k, side by side (32 bytes). So one
 * product streams the weights as one sequential read per thread, and one 32-byte load gives a
 * register block's 16 columns at one k. Within those 16 values the columns go 0-3, 8-11, 4-7,
 * 12-15: interleaving them with zeros (unpacklo/unpackhi, which work within 128-bit lanes)
 * widens them to columns 0-7 and 8-15 in fp32, two instructions for 16 weights.
 *
 * Shape of the work: x is widened once into an fp32 scratch; the panels are split between the
 * threads. One row (decode) runs down each panel with eight accumulators (four steps along K
 * in flight: one FMA's latency is four of them), prefetching ahead in the sequential stream.
 * More rows take a GEMM's register blocking: a 6 x 16 block of the output in twelve
 * accumulators, each step along K one weight load and 6 broadcast x values into 12 FMAs, so
 * the FMA units set the pace. A panel serves the rows in blocks of 6, KC steps along K at a
 * time so its slice stays in L1, and the first row block prefetches the next panel. Long
 * prefills take the rows in chunks of about CHUNK_BYTES of x (each panel reads all of a chunk).
 *
 * Arithmetic: products and sums in fp32 (one row: four interleaved partial sums per output,
 * added at the end; more rows: one chain along K), the bias added in fp32, one rounding to bf16
 * (nearest even, NaN kept quiet) at the store.
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
#include <omp.h> /* (built with -fopenmp, as every kernel here) */

#include "ae_kernels.h"
#include "bf16.h"

#define MR 6  /* output rows per register block */
#define NR 16 /* output columns per panel and register block (two vectors of 8) */
#define KC 256 /* steps along K per pass: an 8 KB slice of a panel, which stays in L1 */
/* x rows per pass over the weights: about this many bytes of fp32 x, which every panel reads
 * (from L2 or L3, not memory, however long the prefill chunk) */
#define CHUNK_BYTES (2 << 20)
/* One row: how far ahead of its reads the prefetch runs, in bytes of the panel stream */
#define GEMV_PREFETCH 1024

/* Where column j (0..15) of a panel's k-th group of 16 sits: 0-3, 8-11, 4-7, 12-15 swapped into
 * the order unpacklo/unpackhi take them (the map is its own inverse). */
static inline int slot(int j) { return (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1); }

#if AE_DENSE_SIMD
/* The 16 weights at p (one k of a panel) widened to fp32: columns 0-7 in lo, 8-15 in hi. */
static inline __attribute__((always_inline)) void widen16(const uint16_t *p, __m256 *lo,
                                                          __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
#endif

/* acc[0..16) = x . panel's 16 columns, for one row of x (K values). */
static void gemv_panel(const float *x, int64_t K, const uint16_t *panel, float *acc) {
    int64_t k = 0;
#if AE_DENSE_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0,
           d1 = a0;
    const char *ahead = (const char *)panel + GEMV_PREFETCH;
    for (; k + 4 <= K; k += 4) {
        __builtin_prefetch(ahead + 32 * k, 0, 3);
        __builtin_prefetch(ahead + 32 * k + 64, 0, 3);
        const uint16_t *p = panel + k * NR;
        __m256 lo, hi, xv;
        widen16(p, &lo, &hi), xv = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xv, lo, a0), a1 = _mm256_fmadd_ps(xv, hi, a1);
        widen16(p + NR, &lo, &hi), xv = _mm256_broadcast_ss(x + k + 1);
        b0 = _mm256_fmadd_ps(xv, lo, b0), b1 = _mm256_fmadd_ps(xv, hi, b1);
        widen16(p + 2 * NR, &lo, &hi), xv = _mm256_broadcast_ss(x + k + 2);
        c0 = _mm256_fmadd_ps(xv, lo, c0), c1 = _mm256_fmadd_ps(xv, hi, c1);
        widen16(p + 3 * NR, &lo, &hi), xv = _mm256_broadcast_ss(x + k + 3);
        d0 = _mm256_fmadd_ps(xv, lo, d0), d1 = _mm256_fmadd_ps(xv, hi, d1);
    }
    for (; k < K; k++) {
        __m256 lo, hi;
        widen16(panel + k * NR, &lo, &hi);
        const __m256 xv = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xv, lo, a0), a1 = _mm256_fmadd_ps(xv, hi, a1);
    }
    _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0)));
    _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1)));
#else
    for (int j = 0; j < NR; j++) acc[j] = 0.0f;
    for (; k < K; k++)
        for (int j = 0; j < NR; j++) acc[j] += x[k] * bf16_to_f32(panel[k * NR + slot(j)]);
#endif
}

/* acc[r][0..16) += x row r . the panel slice's 16 columns over kc steps along K, for the first
 * R of 6 rows (row stride ldx). With PF, each step also prefetches 32 bytes of `next` (the
 * next panel, which the first row block pulls in while it computes). R and PF are constants
 * after inlining. Twelve named accumulators: GCC kept an array of them in memory, stored at
 * every step. */
static inline __attribute__((always_inline)) void accumulate(const float *x, int64_t ldx,
                                                             int64_t kc, const uint16_t *panel,
                                                             const int R, const int PF,
                                                             const char *next, float *acc) {
#if AE_DENSE_SIMD
    __m256 c00 = _mm256_loadu_ps(acc), c01 = _mm256_loadu_ps(acc + 8), c10 = c00, c11 = c00;
    __m256 c20 = c00, c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (R > 1) c10 = _mm256_loadu_ps(acc + 16), c11 = _mm256_loadu_ps(acc + 24);
    if (R > 2) c20 = _mm256_loadu_ps(acc + 32), c21 = _mm256_loadu_ps(acc + 40);
    if (R > 3) c30 = _mm256_loadu_ps(acc + 48), c31 = _mm256_loadu_ps(acc + 56);
    if (R > 4) c40 = _mm256_loadu_ps(acc + 64), c41 = _mm256_loadu_ps(acc + 72);
    if (R > 5) c50 = _mm256_loadu_ps(acc + 80), c51 = _mm256_loadu_ps(acc + 88);
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx;
#define AE_ROW(i, ci0, ci1, xi)                                                                   \
    if (R > i) {                                                                               \
        const __m256 b = _mm256_broadcast_ss(xi + k);                                          \
        ci0 = _mm256_fmadd_ps(b, w0, ci0);                                                     \
        ci1 = _mm256_fmadd_ps(b, w1, ci1);                                                     \
    }
    /* (one plain loop: unrolled by two, GCC shuffled the accumulators between registers and
     * the kernel ran at 60% of its FMA rate instead of 90%) */
    for (int64_t k = 0; k < kc; k++) {
        if (PF) __builtin_prefetch(next + 32 * k, 0, 1);
        __m256 w0, w1;
        widen16(panel + k * NR, &w0, &w1);
        AE_ROW(0, c00, c01, x0) AE_ROW(1, c10, c11, x1) AE_ROW(2, c20, c21, x2)
        AE_ROW(3, c30, c31, x3) AE_ROW(4, c40, c41, x4) AE_ROW(5, c50, c51, x5)
    }
#undef AE_ROW
    _mm256_storeu_ps(acc, c00), _mm256_storeu_ps(acc + 8, c01);
    if (R > 1) _mm256_storeu_ps(acc + 16, c10), _mm256_storeu_ps(acc + 24, c11);
    if (R > 2) _mm256_storeu_ps(acc + 32, c20), _mm256_storeu_ps(acc + 40, c21);
    if (R > 3) _mm256_storeu_ps(acc + 48, c30), _mm256_storeu_ps(acc + 56, c31);
    if (R > 4) _mm256_storeu_ps(acc + 64, c40), _mm256_storeu_ps(acc + 72, c41);
    if (R > 5) _mm256_storeu_ps(acc + 80, c50), _mm256_storeu_ps(acc + 88, c51);
#else
    (void)next;
    for (int64_t k = 0; k < kc; k++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NR; j++)
                acc[r * NR + j] += x[r * ldx + k] * bf16_to_f32(panel[k * NR + slot(j)]);
#endif
}

/* accumulate() with R and PF constants: one copy of the loop per case, without the absent
 * rows' FMAs */
static void accumulate_rows(const float *x, int64_t ldx, int64_t kc, const uint16_t *panel,
                            int R, const char *next, float *acc) {
    switch (R + (next ? 8 : 0)) {
    case 1: accumulate(x, ldx, kc, panel, 1, 0, next, acc); break;
    case 2: accumulate(x, ldx, kc, panel, 2, 0, next, acc); break;
    case 3: accumulate(x, ldx, kc, panel, 3, 0, next, acc); break;
    case 4: accumulate(x, ldx, kc, panel, 4, 0, next, acc); break;
    case 5: accumulate(x, ldx, kc, panel, 5, 0, next, acc); break;
    case 6: accumulate(x, ldx, kc, panel, 6, 0, next, acc); break;
    case 9: accumulate(x, ldx, kc, panel, 1, 1, next, acc); break;
    case 10: accumulate(x, ldx, kc, panel, 2, 1, next, acc); break;
    case 11: accumulate(x, ldx, kc, panel, 3, 1, next, acc); break;
    case 12: accumulate(x, ldx, kc, panel, 4, 1, next, acc); break;
    case 13: accumulate(x, ldx, kc, panel, 5, 1, next, acc); break;
    default: accumulate(x, ldx, kc, panel, 6, 1, next, acc); break;
    }
}

/* out[r][n..n+J) = acc[r] + bias, rounded to bf16, for M rows (acc rows of 16 floats). */
static void store_rows(const float *acc, int64_t M, const uint16_t *bias, int64_t n, int J,
                       uint16_t *out, int64_t ldo) {
#if AE_DENSE_SIMD
    if (J == NR) { /* whole panels: bias and rounding 8 lanes at a time */
        __m256 b0 = _mm256_setzero_ps(), b1 = b0;
        if (bias) b0 = load8_bf16(bias + n), b1 = load8_bf16(bias + n + 8);
        for (int64_t r = 0; r < M; r++) {
            __m128i lo = round8_bf16(_mm256_add_ps(_mm256_loadu_ps(acc + r * NR), b0));
            __m128i hi = round8_bf16(_mm256_add_ps(_mm256_loadu_ps(acc + r * NR + 8), b1));
            _mm_storeu_si128((__m128i *)(out + r * ldo + n), lo);
            _mm_storeu_si128((__m128i *)(out + r * ldo + n + 8), hi);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < M; r++)
        for (int j = 0; j < J; j++)
            out[r * ldo + n + j] =
                f32_to_bf16(acc[r * NR + j] + (bias ? bf16_to_f32(bias[n + j]) : 0.0f));
}

/* Panels [p0, p1) of every row in [0, M): one row by gemv_panel, more by register blocks over
 * chunks of `chunk` rows. acc: chunk x 16 floats of the thread's own. */
static void panels(const float *xf, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                   const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t p0, int64_t p1,
                   int64_t chunk, float *acc) {
    if (M == 1) {
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n = p * NR;
            gemv_panel(xf, K, w + n * K, acc);
            store_rows(acc, 1, bias, n, N - n < NR ? (int)(N - n) : NR, out, ldo);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n = p * NR;
            const uint16_t *panel = w + n * K;
            /* the next panel (32 K bytes) comes in during this one's first row block */
            const char *next = p + 1 < p1 ? (const char *)(panel + NR * K) : NULL;
            memset(acc, 0, (size_t)(rows * NR) * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t m = 0; m < rows; m += MR) {
                    const int R = rows - m < MR ? (int)(rows - m) : MR;
                    accumulate_rows(xf + (m0 + m) * K + k0, K, kc, panel + k0 * NR, R,
                                    m == 0 && next ? next + 32 * k0 : NULL, acc + m * NR);
                }
            }
            store_rows(acc, rows, bias, n, N - n < NR ? (int)(N - n) : NR, out + m0 * ldo, ldo);
        }
    }
}

/* 64-byte aligned memory (aligned_alloc wants a multiple of the alignment) */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int ae_linear_dense_simd(void) { return AE_DENSE_SIMD; }

void ae_dense_panel_order(int32_t *order) {
    for (int j = 0; j < NR; j++) order[j] = slot(j);
}

int ae_linear_bf16_dense(const void *x_, int64_t ldx, int64_t M, const void *w_, int64_t N,
                         int64_t K, const void *bias_, void *out_, int64_t ldo, int threads) {
    const uint16_t *x = (const uint16_t *)x_, *w = (const uint16_t *)w_;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *out = (uint16_t *)out_;
    if (M <= 0 || N <= 0) return 0;
    const int64_t num_panels = (N + NR - 1) / NR;
    /* rows per chunk: whole register blocks, about CHUNK_BYTES of fp32 x */
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float));
    chunk = chunk < 8 * MR ? 8 * MR : chunk - chunk % MR;
    if (chunk > M) chunk = M;
    if (threads < 1) threads = 1;
    if (num_panels < threads) threads = (int)num_panels;
    float *xf = (float *)alloc64((size_t)(M * K) * sizeof(float));
    float *accs = (float *)alloc64((size_t)(threads * chunk * NR) * sizeof(float));
    if (!xf || !accs) {
        free(xf);
        free(accs);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        widen_rows(x, ldx, M, K, xf); /* every row, before any thread reads one */
        const int64_t p0 = num_panels * t / T, p1 = num_panels * (t + 1) / T;
        panels(xf, M, K, w, N, bias, out, ldo, p0, p1, chunk, accs + t * chunk * NR);
    }
    free(xf);
    free(accs);
    return 0;
}
