/*
 * Linear layers over GGUF's K-quant weights, Q4_K, Q5_K and Q6_K (super-blocks of 256 values),
 * read as a GGUF file stores them, with x's rows quantized to int8 blocks of 32 on the way in
 * (ae_quantize_rows_q8, as quant_legacy.c). Reached through ae_linear_quant (quant_legacy.c).
 */

#include <stdint.h>

#include "ae_kernels.h"

/* Bit f set for each K-quant format code f this file runs. */
int ae_kquant_formats(void) { return 0; }

int ae_linear_kquant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                     int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                     int num_threads) {
    (void)fmt, (void)dt, (void)x, (void)x_st, (void)M, (void)w, (void)N, (void)K, (void)bias;
    (void)out, (void)o_st, (void)num_threads;
    return -3;
}
