/*
 * linear.c's building blocks, for other kernels over the same packed bf16 weights
 * (lm_head_argmax.c): the layout and the one-block product are described at linear.c's top.
 */
#ifndef AE_LINEAR_H
#define AE_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#include "ae_vec.h"
#include "bf16.h"
#include "pool.h"

#define AE_LINEAR_BLOCK 64 /* output columns per packed block */

/* res[m][0..63] = the fp32 column sums of the packed block at wb for the M rows at xp (as
 * k-pairs, P per row): the sums ae_linear_bf16 rounds into its outputs. */
void ae_block_sums(const char *wb, int64_t P, const uint32_t *xp, int64_t M, float *res);

/* x's M rows (row stride x_st) as k-pairs zero padded to P pairs: in the pool's buffer 0
 * where the caller holds the pool (`pooled`), else in fresh memory the caller frees. */
uint32_t *ae_rows_as_pairs(int pooled, const void *x, int64_t x_st, int64_t M, int64_t K,
                           int64_t P);

/* The calling thread's scratch of at least `floats` floats (grown as needed, never freed). */
float *ae_thread_scratch(size_t floats);

/* Whether a product of M rows runs on the pool; 1 means the caller now holds it and must
 * release it (ae_pool_release). */
int ae_linear_use_pool(int64_t M, int num_threads);

/* fn(ctx, item, commit) for items < n: on the pool where `pooled`, else in an OpenMP team of
 * up to num_threads, each thread a contiguous range. */
void ae_linear_run_items(int pooled, ae_pool_fn fn, const void *ctx, size_t ctx_bytes, int64_t n,
                         int num_threads);

/* A block's column sum plus bias (bf16, or NULL) for column n, rounded to bf16 and widened
 * back: the value the product stores. */
static inline float ae_product_value(const float *res, const void *bias, int64_t n) {
    float v = *res;
    if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n]);
    return bf16_to_f32(f32_to_bf16(v));
}

/* M rows of `cols` fp32 sums (res, row stride res_st) plus bias (dtype dt, or NULL; read
 * into bias_buf, room for cols floats) stored as dt into out's columns n0.. (row stride
 * o_st): how the quantized products end. */
static inline void ae_store_rows(float *res, int64_t res_st, int64_t M, int64_t cols,
                                 const void *bias, float *bias_buf, int dt, void *out,
                                 int64_t o_st, int64_t n0) {
    if (bias) load_f32((const char *)bias + n0 * elem_size(dt), bias_buf, cols, dt);
    for (int64_t m = 0; m < M; m++) {
        float *row = res + m * res_st;
        if (bias)
            for (int64_t c = 0; c < cols; c++) row[c] += bias_buf[c];
        store_f32((char *)out + (m * o_st + n0) * elem_size(dt), row, cols, dt);
    }
}

/* An item's M rows of `cols` fp32 sums (res, row stride cols; res + M * cols holds cols more
 * floats of room for the bias) stored by ae_store_rows, if this thread commits the item (see
 * pool.h); the quantized products' items end so. */
static inline void ae_commit_rows(const struct ae_commit *commit, float *res, int64_t M,
                                  int64_t cols, const void *bias, int dt, void *out,
                                  int64_t o_st, int64_t n0) {
    if (!ae_commit_begin(commit)) return; /* another thread committed this item */
    ae_store_rows(res, cols, M, cols, bias, res + M * cols, dt, out, o_st, n0);
    ae_commit_end(commit);
}

#endif
