/*
 * Q8_0 products of many rows on AVX2 machines (without AVX512-VNNI), in fp32: the weights
 * dequantized a chunk at a time (q * d is exact in fp32) and multiplied with fp32 FMAs by x
 * as it is, not quantized.
 *
 * Why: AVX2 has no signed-by-signed byte product. quant_gemm_avx2.c multiplies Q8_0's signed
 * values as |q| by a with q's sign (vpsignb), and the int16 pairs of such products (up to
 * 2 * 128 * 127) leave no room to add two groups before widening them to int32: an extra
 * sign and a widening per 4 values, where the 4- and 5-bit formats widen once per 16-32. On
 * an AVX2-only Zen 1 (one thread, 2048 x 2048 from L3, 64 rows of x) that tile ran 13.1
 * multiply-adds per ns, the fp32 FMAs of linear_dense.c 18.3 and Q5_0's tile 23.4. Taken on
 * such cores only (half_width_vectors, below), or where ae_quant_gemm_f32_set says.
 *
 * Layout: x's rows, widened to fp32, in blocks of XB = 16 rows, k-major within a block (16
 * floats per k: two ymm), so that a register block runs 16 rows of x against NB = 4 weight
 * rows, each step along K two loads of x, four broadcast weights and eight FMAs (eight
 * accumulators). A work item is a panel of GEMM_PANEL weight rows: KC values of K at a time
 * dequantized (row-major, KC floats per row) and every block of x run over them; the sums
 * gather in a [weight row][x row] scratch, stored transposed at the end. Long prefills pass
 * over the weights once per CHUNK_BYTES of x.
 *
 * Arithmetic: the products and sums in fp32, one chain per output along K (in K order), the
 * bias added in fp32, one rounding to out's dtype.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "linear.h"
#include "quant_gemm.h"

#ifdef HAVE_GEMM_AVX2
#include <cpuid.h>
#include <immintrin.h>

#define PANEL GEMM_PANEL
#define XB 16  /* rows of x per register block */
#define NB 4   /* weight rows per register block */
#define KC 256 /* values of K per chunk: a block of x's slice (16 KB) stays in L1 */
/* x's rows per pass over the weights: about this many bytes of fp32 x, which every panel
 * reads (from L2 or L3, not memory, however long the prefill), as linear_dense.c's */
#define CHUNK_BYTES (2 << 20)

struct f32_job {
    const uint8_t *w; /* Q8_0 rows of nb blocks */
    const void *bias;
    void *out;
    const float *xt; /* [m_pad / XB][K][XB] */
    int64_t M, m_pad, N, K, nb, o_st;
    int dt;
};

/* Rows n0 .. n0 + cols - 1, values k0 .. k0 + kc, dequantized into wf (row c at c * kc). */
static void dequant_chunk(const struct f32_job *j, int64_t n0, int64_t cols, int64_t k0,
                          int64_t kc, float *restrict wf) {
    const int64_t row_bytes = j->nb * 34;
    for (int64_t c = 0; c < cols; c++) {
        const uint8_t *b = j->w + (n0 + c) * row_bytes + k0 / 32 * 34;
        float *dst = wf + c * kc;
        for (int64_t i = 0; i < kc / 32; i++, b += 34, dst += 32) {
            const __m256 d = _mm256_set1_ps(gemm_f16_at(b));
            for (int e = 0; e < 4; e++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * e));
                _mm256_storeu_ps(dst + 8 * e,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
    }
}

/* acc[n][0..XB) (row stride m_pad) += the block of x (xb: kc steps of XB floats) . weight rows
 * wf + n * kc for n < R (R <= NB, constant after inlining); acc starts at zero if `first`. */
static ALWAYS_INLINE void block(const int R, const float *restrict xb, const float *restrict wf,
                                int64_t kc, float *restrict acc, int64_t m_pad, int first) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00;
    if (!first) {
        a00 = _mm256_loadu_ps(acc), a01 = _mm256_loadu_ps(acc + 8);
        if (R > 1) a10 = _mm256_loadu_ps(acc + m_pad), a11 = _mm256_loadu_ps(acc + m_pad + 8);
        if (R > 2)
            a20 = _mm256_loadu_ps(acc + 2 * m_pad), a21 = _mm256_loadu_ps(acc + 2 * m_pad + 8);
        if (R > 3)
            a30 = _mm256_loadu_ps(acc + 3 * m_pad), a31 = _mm256_loadu_ps(acc + 3 * m_pad + 8);
    }
    const float *w0 = wf, *w1 = wf + kc, *w2 = wf + 2 * kc, *w3 = wf + 3 * kc;
    for (int64_t k = 0; k < kc; k++) {
        const __m256 x0 = _mm256_load_ps(xb + XB * k), x1 = _mm256_load_ps(xb + XB * k + 8);
        __m256 b = _mm256_broadcast_ss(w0 + k);
        a00 = _mm256_fmadd_ps(b, x0, a00), a01 = _mm256_fmadd_ps(b, x1, a01);
        if (R > 1) {
            b = _mm256_broadcast_ss(w1 + k);
            a10 = _mm256_fmadd_ps(b, x0, a10), a11 = _mm256_fmadd_ps(b, x1, a11);
        }
        if (R > 2) {
            b = _mm256_broadcast_ss(w2 + k);
            a20 = _mm256_fmadd_ps(b, x0, a20), a21 = _mm256_fmadd_ps(b, x1, a21);
        }
        if (R > 3) {
            b = _mm256_broadcast_ss(w3 + k);
            a30 = _mm256_fmadd_ps(b, x0, a30), a31 = _mm256_fmadd_ps(b, x1, a31);
        }
    }
    _mm256_storeu_ps(acc, a00), _mm256_storeu_ps(acc + 8, a01);
    if (R > 1) _mm256_storeu_ps(acc + m_pad, a10), _mm256_storeu_ps(acc + m_pad + 8, a11);
    if (R > 2) _mm256_storeu_ps(acc + 2 * m_pad, a20), _mm256_storeu_ps(acc + 2 * m_pad + 8, a21);
    if (R > 3) _mm256_storeu_ps(acc + 3 * m_pad, a30), _mm256_storeu_ps(acc + 3 * m_pad + 8, a31);
}

static void block_rows(int R, const float *xb, const float *wf, int64_t kc, float *acc,
                       int64_t m_pad, int first) {
    switch (R) {
    case 1: block(1, xb, wf, kc, acc, m_pad, first); break;
    case 2: block(2, xb, wf, kc, acc, m_pad, first); break;
    case 3: block(3, xb, wf, kc, acc, m_pad, first); break;
    default: block(4, xb, wf, kc, acc, m_pad, first); break;
    }
}

/* Panel p (an ae_pool_fn): weight rows p * PANEL .. against every row of x. */
static void f32_panel(const void *ctx, int64_t p, const struct ae_commit *commit) {
    const struct f32_job *j = ctx;
    const int64_t K = j->K, m_pad = j->m_pad, n0 = p * PANEL;
    const int64_t cols = j->N - n0 < PANEL ? j->N - n0 : PANEL, kc_max = K < KC ? K : KC;
    /* wf: PANEL rows of a chunk; acc: [PANEL][m_pad]; res: [m_pad][PANEL] (+ the bias's) */
    float *wf = ae_thread_scratch((size_t)(PANEL * kc_max + 2 * PANEL * m_pad + PANEL) + 16);
    wf += (64 - (uintptr_t)wf % 64) % 64 / sizeof(float);
    float *acc = wf + PANEL * kc_max, *res = acc + PANEL * m_pad;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        dequant_chunk(j, n0, cols, k0, kc, wf);
        for (int64_t m = 0; m < m_pad; m += XB)
            for (int64_t n = 0; n < cols; n += NB)
                block_rows(cols - n < NB ? (int)(cols - n) : NB, j->xt + (m * K + k0 * XB),
                           wf + n * kc, kc, acc + n * m_pad + m, m_pad, k0 == 0);
    }
    for (int64_t m = 0; m < j->M; m++)
        for (int64_t n = 0; n < cols; n++) res[m * PANEL + n] = acc[n * m_pad + m];
    if (!ae_commit_begin(commit)) return; /* another thread committed this panel */
    ae_store_rows(res, PANEL, j->M, cols, j->bias, res + j->M * PANEL, j->dt, j->out, j->o_st,
                  n0);
    ae_commit_end(commit);
}

/* r[i] = column i of the 8 x 8 floats in r (rows r[0..8)). */
static ALWAYS_INLINE void transpose_8x8(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);     /* 0 of i, i + 1, 1 of i, i + 1 | 4, 5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);     /* column 0 of rows i .. i + 3 | 4 */
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee); /* 1 | 5 */
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44); /* 2 | 6 */
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee); /* 3 | 7 */
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
}

/* x's M rows (dtype dt, row stride x_st) widened into xt: blocks of XB rows, k-major within
 * (xt[(b * K + k) * XB + i] = row b * XB + i's value k; xt 32-byte aligned), the rows from M
 * to m_pad zero. Eight rows at a time, 256 values of each widened and 8 x 8 transposed. */
static void widen_blocks(const void *x, int dt, int64_t x_st, int64_t M, int64_t m_pad, int64_t K,
                         float *restrict xt) {
    float tmp[8][256] __attribute__((aligned(32)));
    for (int64_t m0 = 0; m0 < m_pad; m0 += 8) {
        float *dst = xt + m0 / XB * XB * K + m0 % XB;
        for (int64_t k0 = 0; k0 < K; k0 += 256) {
            const int64_t n = K - k0 < 256 ? K - k0 : 256; /* a multiple of 32 */
            for (int64_t i = 0; i < 8; i++) {
                if (m0 + i < M)
                    load_f32((const char *)x + ((m0 + i) * x_st + k0) * elem_size(dt), tmp[i], n,
                             dt);
                else memset(tmp[i], 0, (size_t)n * sizeof(float));
            }
            for (int64_t k = 0; k < n; k += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(tmp[i] + k);
                transpose_8x8(r);
                for (int j = 0; j < 8; j++) _mm256_store_ps(dst + (k0 + k + j) * XB, r[j]);
            }
        }
    }
}

int ae_quant_gemm_f32(const void *x, int dt, int64_t x_st, int64_t M, const void *w, int64_t N,
                      int64_t K, const void *bias, void *out, int64_t o_st, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    /* rows per pass over the weights: whole blocks, about CHUNK_BYTES of fp32 x */
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float));
    chunk = chunk < 4 * XB ? 4 * XB : chunk - chunk % XB;
    if (chunk > M) chunk = (M + XB - 1) / XB * XB;
    const int pooled = panels <= AE_POOL_MAX_ITEMS && ae_linear_use_pool(M, num_threads);
    const size_t bytes = (size_t)(chunk * K) * sizeof(float) + 64;
    char *buf = pooled ? ae_pool_buffer(0, bytes) : malloc(bytes);
    if (buf == NULL) {
        if (pooled) ae_pool_release();
        return -1;
    }
    float *xt = (float *)(buf + (64 - (uintptr_t)buf % 64) % 64);
    const int64_t x_row = x_st * elem_size(dt), o_row = o_st * elem_size(dt);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk, m_pad = (rows + XB - 1) / XB * XB;
        widen_blocks((const char *)x + m0 * x_row, dt, x_st, rows, m_pad, K, xt);
        const struct f32_job job = {
            w, bias, (char *)out + m0 * o_row, xt, rows, m_pad, N, K, K / 32, o_st, dt,
        };
        ae_linear_run_items(pooled, f32_panel, &job, sizeof job, panels, num_threads);
    }
    if (pooled) ae_pool_release();
    else free(buf);
    return 0;
}

/* Whether this CPU's cores run 256-bit vectors as two 128-bit halves: AMD family 17h before
 * model 30h (Zen 1, Zen+), whose one vector integer multiply pipe bounds the integer GEMM's
 * Q8_0 tile where its two FMA pipes run the fp32 product 1.25-1.32x faster (above). On cores
 * with whole 256-bit units the two measured about level (Zen 4 on its AVX2 path: the integer
 * tile at ~15 multiply-adds a cycle, fp32 FMAs at most 16), so they keep the integer GEMM. */
static int half_width_vectors(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541) return 0; /* "AuthenticAMD" */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned family = ((a >> 8) & 0xf) + ((a >> 20) & 0xff);
    const unsigned model = ((a >> 4) & 0xf) | ((a >> 12) & 0xf0);
    return family == 0x17 && model < 0x30;
}

static int f32_on = -1; /* -1: not decided yet (the CPU's default at the first call) */

int ae_quant_gemm_f32_set(int on) {
    if (on >= 0) f32_on = on > 0;
    else if (on == -1 || f32_on < 0) f32_on = half_width_vectors();
    return f32_on;
}

int ae_quant_gemm_f32_min_rows(int fmt) {
    const int avx2 = ae_quant_set_path(-2) == AE_QUANT_PATH_AVX2;
    return fmt == AE_QUANT_Q8_0 && avx2 && ae_quant_gemm_f32_set(-2) ? AE_GEMM_F32_ROWS : 0;
}

#else

int ae_quant_gemm_f32_set(int on) {
    (void)on;
    return 0;
}

int ae_quant_gemm_f32_min_rows(int fmt) {
    (void)fmt;
    return 0;
}

#endif
