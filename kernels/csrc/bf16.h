/* bf16 <-> fp32 conversions shared by the native CPU kernels (scalar; the vector forms live
 * beside the loops that use them). */
#ifndef AE_BF16_H
#define AE_BF16_H

#include <stdint.h>
#include <string.h>

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

/* Inside an OpenMP parallel region: x's M rows (row stride ldx) widened into xf (M x K,
 * dense), the rows split between the team; the loop's barrier ends it, every row widened. */
static inline void widen_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xf) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(x[m * ldx + k]);
}

#endif
