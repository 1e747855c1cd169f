/*
 * Greedy sampling's argmax over rows of logits in their own dtype (ae_argmax_rows).
 */

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "pool.h"

#if !defined(__AVX512F__) && defined(__AVX2__)
/* 16 values of dtype dt at p as two 8-lane fp32 halves (load16_as_f32's generic lowering of
 * the half-precision types took 2-4x the time on AMD Zen 1). */
static inline void load16_avx2(const char *p, int dt, __m256 v[2]) {
    if (dt == AE_BF16) {
        const __m128i *q = (const __m128i *)p;
        v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16));
        v[1] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16));
        return;
    }
#ifdef __F16C__
    if (dt == AE_F16) {
        v[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        v[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1));
        return;
    }
#endif
    const v16f w = load16_as_f32(p, dt);
    memcpy(v, &w, 2 * sizeof(__m256));
}
#endif

/* argmax of one row of n fp32-widened values at p (dtype dt): see ae_argmax_rows; *has_nan
 * set to whether the row holds a NaN. */
static inline int64_t argmax_row(const char *p, int64_t n, int dt, int *has_nan) {
    const int64_t es = elem_size(dt);
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#ifdef __AVX512F__
    /* two passes of 16 lanes: the maximum (and whether a NaN is there), then its first index */
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = (__m512)load16_as_f32(p + i * es, dt);
        vm = _mm512_max_ps(vm, v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    m = _mm512_reduce_max_ps(vm);
    nan = unordered != 0;
#elif defined(__AVX2__)
    /* the same on two 8-lane halves (the scalar loop below ran 49,152 bf16 logits in 70 us
     * on AMD Zen 1, a tenth of a one-stream step's time outside the products) */
    __m256 vm0 = _mm256_set1_ps(-INFINITY), vm1 = vm0, unordered = _mm256_setzero_ps();
    for (; i + LANES <= n; i += LANES) {
        __m256 v[2];
        load16_avx2(p + i * es, dt, v);
        vm0 = _mm256_max_ps(vm0, v[0]);
        vm1 = _mm256_max_ps(vm1, v[1]);
        unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(vm0, vm1));
    for (int t = 0; t < 8; t++) m = lanes[t] > m ? lanes[t] : m;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; i += LANES) { /* the rest (everything, without AVX-512), 16 at a time */
        const int64_t c = n - i < LANES ? n - i : LANES;
        float chunk[LANES];
        load_f32(p + i * es, chunk, c, dt);
        for (int64_t t = 0; t < c; t++) {
            m = chunk[t] > m ? chunk[t] : m;
            nan |= chunk[t] != chunk[t];
        }
    }
    *has_nan = nan;
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(m);
    for (; j + LANES <= n; j += LANES) {
        const __m512 v = (__m512)load16_as_f32(p + j * es, dt);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    const __m256 target = _mm256_set1_ps(m);
    for (; j + LANES <= n; j += LANES) {
        __m256 v[2];
        load16_avx2(p + j * es, dt, v);
        const __m256 h0 = nan ? _mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q)
                              : _mm256_cmp_ps(v[0], target, _CMP_EQ_OQ);
        const __m256 h1 = nan ? _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)
                              : _mm256_cmp_ps(v[1], target, _CMP_EQ_OQ);
        const int hit = _mm256_movemask_ps(h0) | _mm256_movemask_ps(h1) << 8;
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < n; j++) {
        float v;
        load_f32(p + j * es, &v, 1, dt);
        if (nan ? v != v : v == m) return j;
    }
    return 0; /* unreachable for n > 0 */
}

/*
 * out[r] = argmax of row r (n values, row stride x_st elements), as torch.argmax: the first
 * index of the maximum, or of the first NaN when the row has one. Returns how many rows hold
 * a NaN (a sampler fails those requests: the caller needs no second pass to find them).
 *
 * Up to AE_POOL_MAX_ROWS rows (a decode step on linear.c's pool) run in the calling thread:
 * an OpenMP team's idle thread spins for milliseconds after its region ends, on a core the
 * pool's helper needs for the next step's products (AMD Zen 4, 2 cores: a 1B Q4_K_M model's
 * greedy decode step, whose argmax follows its quantized lm_head, 32.0-32.4 ms with the
 * region, 27.1-29.2 without), and a row is one thread's work anyway (~20 us at 128k values).
 */
int64_t ae_argmax_rows(int dt, const void *x, int64_t x_st, int64_t rows, int64_t n,
                       int64_t *out, int num_threads) {
    const int64_t es = elem_size(dt);
    int64_t nan_rows = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : nan_rows) \
    if (rows > AE_POOL_MAX_ROWS && rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * x_st * es;
        int has_nan;
        if (dt == AE_BF16)
            out[r] = argmax_row(row, n, AE_BF16, &has_nan);
        else if (dt == AE_F32)
            out[r] = argmax_row(row, n, AE_F32, &has_nan);
        else
            out[r] = argmax_row(row, n, AE_F16, &has_nan);
        nan_rows += has_nan;
    }
    return nan_rows;
}
