/*
 * The gated MLP's activation, silu(gate) * up (ae_silu_mul), rounded to the dtype where torch
 * rounds.
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
#include "fast_exp.h"

/*
 * out = silu(gate) * up over `rows` rows of n values, as torch computes
 * `act_fn(gate) * up` in the dtype: silu in fp32, rounded to the dtype, times up, rounded.
 */
void ae_silu_mul(int dt, const void *gate, int64_t g_st, const void *up, int64_t u_st, void *out,
                 int64_t o_st, int64_t rows, int64_t n, int num_threads) {
    const int64_t es = elem_size(dt);
#pragma omp parallel num_threads(num_threads) if (rows * n >= 32768)
    {
        float *g = malloc((size_t)n * sizeof(float));
        float *u = malloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_f32((const char *)gate + r * g_st * es, g, n, dt);
            load_f32((const char *)up + r * u_st * es, u, n, dt);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) g[i] = silu_f32(g[i]);
            round_row(g, n, dt);
            for (int64_t i = 0; i < n; i++) g[i] *= u[i];
            store_f32((char *)out + r * o_st * es, g, n, dt);
        }
        free(g);
        free(u);
    }
}
