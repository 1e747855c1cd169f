/*
 * RMSNorm (ae_rms_norm) and the pre-norm decoder's residual add then RMSNorm (ae_add_rms_norm),
 * rounded to the dtype where transformers' LlamaRMSNorm rounds. The row functions are shared
 * with other files (see ae_kernels.h): rotary_cache.c's per-head norms run rms_norm_row, and
 * linear.c's product that ends in the norm runs ae_add_rms_norm_row, so that every kernel that
 * normalises gives the same numbers.
 */

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ae_kernels.h"
#include "ae_vec.h"

/* RMSNorm of one row of n fp32 values in place, as transformers' LlamaRMSNorm computes it:
 * the mean square in fp32, the normalised row rounded to the dtype, then times the weight
 * (w: the dtype's values widened), rounded again (by the caller's store). The sum of squares
 * is never inlined: every kernel that normalises then runs the same machine code for it, so
 * the same summation order (the compiler may vectorise a reduction differently in each place
 * it is inlined), and the lean forward's fp32 numbers equal those of the model with only its
 * norms swapped. */
static __attribute__((noinline)) float sum_squares(const float *restrict buf, int64_t n) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; i++) sq += buf[i] * buf[i];
    return sq;
}

/* Not static: rotary_cache.c's per-head norms run it too (declared in ae_kernels.h). */
__attribute__((noinline)) void rms_norm_row(float *restrict buf, const float *restrict w, int64_t n,
                                            float eps, int dt) {
    const float inv = 1.0f / sqrtf(sum_squares(buf, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) buf[i] *= inv;
    round_row(buf, n, dt);
    for (int64_t i = 0; i < n; i++) buf[i] *= w[i];
}

/* The bf16 rows of the two norms below, n a multiple of 16, in registers: rms_norm_row's
 * arithmetic and roundings, with the sum of squares from sum_squares over buf (the row as
 * widened bf16), but two passes over the row instead of about ten over buffers: 2-3x faster. */
static ALWAYS_INLINE void normalize_row_bf16(const float *restrict buf, const float *restrict w,
                                             uint16_t *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(buf, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i += LANES)
        store16_bf16(out + i, round16_bf16(load16(buf + i) * inv) * load16(w + i));
}

/* residual += x (rounded), buf = the sum widened, then out = RMSNorm(buf) */
static ALWAYS_INLINE void add_rms_norm_row_bf16(const uint16_t *x, uint16_t *res, uint16_t *out,
                                                const float *restrict w, float *restrict buf,
                                                int64_t n, float eps) {
    for (int64_t i = 0; i < n; i += LANES) {
        const v16f sum = load16_as_f32((const char *)(res + i), AE_BF16) +
                         load16_as_f32((const char *)(x + i), AE_BF16);
        const v16u32 bits = round16_bf16_bits(sum);
        const v16u16 h = __builtin_convertvector(bits, v16u16);
        memcpy(res + i, &h, sizeof h);
        const v16u32 wide = bits << 16;
        memcpy(buf + i, &wide, sizeof wide);
    }
    normalize_row_bf16(buf, w, out, n, eps);
}

/*
 * RMSNorm of `rows` rows of n values (row strides x_st / o_st in elements), as transformers'
 * LlamaRMSNorm computes it (see rms_norm_row).
 */
void ae_rms_norm(int dt, const void *x, int64_t x_st, void *out, int64_t o_st,
                 const void *weight, int64_t rows, int64_t n, float eps, int num_threads) {
    const int64_t es = elem_size(dt);
#pragma omp parallel num_threads(num_threads) if (rows * n >= 32768)
    {
        float *buf = malloc((size_t)n * sizeof(float));
        float *w = malloc((size_t)n * sizeof(float));
        load_f32(weight, w, n, dt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_f32((const char *)x + r * x_st * es, buf, n, dt);
            if (dt == AE_BF16 && n % LANES == 0) {
                normalize_row_bf16(buf, w, (uint16_t *)out + r * o_st, n, eps);
                continue;
            }
            rms_norm_row(buf, w, n, eps, dt);
            store_f32((char *)out + r * o_st * es, buf, n, dt);
        }
        free(buf);
        free(w);
    }
}

/* Row r of ae_add_rms_norm, in the calling thread: w, the weight widened to fp32; buf and
 * other, n floats of scratch each. (Also the second half of the linear kernel that ends in
 * this norm, linear.c: the same code, so the same numbers.) */
void ae_add_rms_norm_row(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                         void *out, int64_t o_st, const float *w, float *buf, float *other,
                         int64_t r, int64_t n, float eps) {
    const int64_t es = elem_size(dt);
    char *res = (char *)residual + r * r_st * es;
    if (dt == AE_BF16 && n % LANES == 0) {
        add_rms_norm_row_bf16((const uint16_t *)x + r * x_st, (uint16_t *)res,
                              (uint16_t *)out + r * o_st, w, buf, n, eps);
        return;
    }
    load_f32(res, buf, n, dt);
    load_f32((const char *)x + r * x_st * es, other, n, dt);
    for (int64_t i = 0; i < n; i++) buf[i] += other[i];
    store_f32(res, buf, n, dt);
    round_row(buf, n, dt);
    rms_norm_row(buf, w, n, eps, dt);
    store_f32((char *)out + r * o_st * es, buf, n, dt);
}

/*
 * A pre-norm decoder's residual step, `residual = residual + x; out = RMSNorm(residual)`:
 * the sum rounded to the dtype (as torch's add) and stored back into `residual` in place, then
 * normalised as ae_rms_norm does. Row strides x_st / r_st / o_st in elements.
 */
void ae_add_rms_norm(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                     void *out, int64_t o_st, const void *weight, int64_t rows, int64_t n,
                     float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * n >= 32768)
    {
        float *buf = malloc((size_t)n * sizeof(float));
        float *other = malloc((size_t)n * sizeof(float));
        float *w = malloc((size_t)n * sizeof(float));
        load_f32(weight, w, n, dt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            ae_add_rms_norm_row(dt, x, x_st, residual, r_st, out, o_st, w, buf, other, r, n, eps);
        free(buf);
        free(other);
        free(w);
    }
}
