/*
 * bf16 products of several rows over plain row-major weights, for CPUs with AVX2 and FMA but no
 * AVX512-BF16: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and out bf16. ae_linear_bf16_dense
 * (linear_dense.c) sends every row count but 1, 4 and 8 here: prefill chunks, batched decode
 * steps, a batch's lm_head.
 *
 * Why: linear_dense.c's kernel takes dot products (a weight row against x rows, summed across
 * a vector at the end): each FMA needs a load of its own, and the horizontal sums and scalar
 * stores add to it. This is a GEMM's register blocking instead: a 6 x 16 block of the output
 * sits in twelve accumulators, and each step along K loads 16 weights and broadcasts 6 x
 * values into 12 FMAs, so the FMA units set the pace: ~90% of their peak in L1, 1.1-1.5x the
 * dot kernel's GFLOP/s from 12 rows up on 2 Zen 3 cores, and ahead of torch's fp32 GEMM on
 * widened copies (which linear_dense_cpu.py used from 128 rows) at every size up to 1024 rows.
 *
 * Shape of the work: x is widened once into an fp32 scratch. The output columns are split
 * between the threads in panels of 16; for each panel a thread widens those 16 weight rows
 * into an fp32 panel laid out k-major (16 consecutive floats per k, transposed 8 x 8 at a time
 * in registers), which then serves the rows in blocks of 6, KC steps along K at a time so its
 * slice stays in L1. The 16 weight rows are contiguous in memory, and the first row block
 * prefetches the next panel's, so the weights stream while the FMAs run. Long prefills take
 * the rows in chunks of about CHUNK_BYTES of x (each panel reads all of a chunk).
 *
 * Arithmetic: products and sums in fp32 (each output's sum in one chain along K), the bias
 * added in fp32, one rounding to bf16 (nearest even, NaN kept quiet) at the store.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AE_GEMM_SIMD 1
#else
#define AE_GEMM_SIMD 0
#endif
#include <omp.h> /* (built with -fopenmp, as every kernel here) */

#include "ae_kernels.h"
#include "bf16.h"

#define MR 6  /* output rows per register block */
#define NR 16 /* output columns per register block (two vectors of 8) */
#define KC 256 /* steps along K per pass: a 16 KB slice of the fp32 panel, which stays in L1 */
/* x rows per pass over the weights: about this many bytes of fp32 x, which every panel reads
 * (from L2 or L3, not memory, however long the prefill chunk) */
#define CHUNK_BYTES (2 << 20)

#if AE_GEMM_SIMD
/* r[i] <- column i of the 8 x 8 block whose rows are r[0..7] */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
#endif

/* panel[k * NR + j] = W[j][k] in fp32 for the J (<= NR) weight rows at w; zero for j >= J. */
static void pack_panel(const uint16_t *w, int64_t K, int J, float *panel) {
    int64_t k = 0;
#if AE_GEMM_SIMD
    for (; k + 8 <= K; k += 8)
        for (int half = 0; half < 2; half++) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                int j = half * 8 + i;
                r[i] = j < J ? load8_bf16(w + j * K + k) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (k + i) * NR + half * 8, r[i]);
        }
#endif
    for (; k < K; k++)
        for (int j = 0; j < NR; j++) panel[k * NR + j] = j < J ? bf16_to_f32(w[j * K + k]) : 0.0f;
}

/* acc[r][0..16) += x row r . panel over kc steps along K, for the first R of 6 rows (row
 * stride ldx). With PF, each step also prefetches 32 bytes of `next` (the next panel's
 * weights, which the first row block pulls in while it computes). R and PF are constants
 * after inlining. Twelve named accumulators: GCC kept an array of them in memory, stored at
 * every step. */
static inline __attribute__((always_inline)) void accumulate(const float *x, int64_t ldx,
                                                             int64_t kc, const float *panel,
                                                             const int R, const int PF,
                                                             const char *next, float *acc) {
#if AE_GEMM_SIMD
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
#define AE_STEP                                                                                 \
    {                                                                                          \
        const __m256 w0 = _mm256_loadu_ps(panel + k * NR);                                     \
        const __m256 w1 = _mm256_loadu_ps(panel + k * NR + 8);                                 \
        AE_ROW(0, c00, c01, x0) AE_ROW(1, c10, c11, x1) AE_ROW(2, c20, c21, x2)                \
        AE_ROW(3, c30, c31, x3) AE_ROW(4, c40, c41, x4) AE_ROW(5, c50, c51, x5)                \
    }
    /* (one plain loop: unrolled by two, GCC shuffled the accumulators between registers and
     * the kernel ran at 60% of its FMA rate instead of 90%) */
    for (int64_t k = 0; k < kc; k++) {
        if (PF) __builtin_prefetch(next + 32 * k, 0, 1);
        AE_STEP
    }
#undef AE_STEP
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
            for (int j = 0; j < NR; j++) acc[r * NR + j] += x[r * ldx + k] * panel[k * NR + j];
#endif
}

/* accumulate() with R and PF constants: one copy of the loop per case, without the absent
 * rows' FMAs */
static void accumulate_rows(const float *x, int64_t ldx, int64_t kc, const float *panel, int R,
                            const char *next, float *acc) {
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
#if AE_GEMM_SIMD
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

/* 64-byte aligned memory (aligned_alloc wants a multiple of the alignment) */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int ae_gemm_bf16_dense(const void *x_, int64_t ldx, int64_t M, const void *w_, int64_t N,
                       int64_t K, const void *bias_, void *out_, int64_t ldo, int threads) {
    const uint16_t *x = (const uint16_t *)x_, *w = (const uint16_t *)w_;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *out = (uint16_t *)out_;
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NR - 1) / NR;
    /* rows per chunk: whole register blocks, about CHUNK_BYTES of fp32 x */
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float));
    chunk = chunk < 8 * MR ? 8 * MR : chunk - chunk % MR;
    if (chunk > M) chunk = M;
    if (threads < 1) threads = 1;
    if (panels < threads) threads = (int)panels;
    float *xf = (float *)alloc64((size_t)(M * K) * sizeof(float));
    float *packs = (float *)alloc64((size_t)(threads * K * NR) * sizeof(float));
    float *accs = (float *)alloc64((size_t)(threads * chunk * NR) * sizeof(float));
    if (!xf || !packs || !accs) {
        free(xf);
        free(packs);
        free(accs);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        widen_rows(x, ldx, M, K, xf); /* every row, before any thread reads one */
        float *panel = packs + t * K * NR, *acc = accs + t * chunk * NR;
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n = p * NR;
                const int J = N - n < NR ? (int)(N - n) : NR;
                pack_panel(w + n * K, K, J, panel);
                /* the next panel's weights (32 K bytes) come in during this one's first rows */
                const char *next =
                    p + 1 < p1 && N - n >= 2 * NR ? (const char *)(w + (n + NR) * K) : NULL;
                memset(acc, 0, (size_t)(rows * NR) * sizeof(float));
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    for (int64_t m = 0; m < rows; m += MR) {
                        const int R = rows - m < MR ? (int)(rows - m) : MR;
                        accumulate_rows(xf + (m0 + m) * K + k0, K, kc, panel + k0 * NR, R,
                                        m == 0 && next ? next + 32 * k0 : NULL, acc + m * NR);
                    }
                }
                store_rows(acc, rows, bias, n, J, out + m0 * ldo, ldo);
            }
        }
    }
    free(xf);
    free(packs);
    free(accs);
    return 0;
}
