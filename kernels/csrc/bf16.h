/* bf16 <-> fp32 conversions shared by the native CPU kernels: scalar, 8 AVX2 lanes, and whole
 * rows (16-lane forms live in ae_vec.h). */
#ifndef AE_BF16_H
#define AE_BF16_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; a NaN stays a quiet NaN. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
}

#ifdef __AVX2__
/* 8 bf16 values at p, widened to fp32 (one shift each) */
static inline __attribute__((always_inline)) __m256 load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 fp32 lanes rounded to bf16 as f32_to_bf16 rounds one */
static inline __attribute__((always_inline)) __m128i round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

/* Inside an OpenMP parallel region: x's M rows (row stride ldx) widened into xf (M x K,
 * dense), the rows split between the team; the loop's barrier ends it, every row widened. */
static inline void widen_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xf) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(x[m * ldx + k]);
}

#endif
