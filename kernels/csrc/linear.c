/*
 * Decode-sized bf16 linear layers over oneDNN's prepacked weights: out = x @ W^T (+ bias).
 *
 * With one to a few rows (one-stream decodes) a linear layer is a matrix-vector product that
 * should run at memory speed, each weight byte read once; oneDNN's one-row kernels reach about
 * half of this machine's bandwidth, and pay more per call. This kernel reads the weight oneDNN
 * packed (kernels/linear_cpu.py checks the layout per layer before it routes a layer here):
 * [ceil(N / 64)][Kp / 2][64][2], blocks of 64 output columns, each a run of k-pairs, the two k
 * values of a column's pair adjacent, zero padded to the 64-column block and to Kp (even) in
 * k. That is the layout AVX512-BF16's dot product wants: one 512-bit load holds 16 columns x 2
 * k, and `vdpbf16ps` with a row's (x[k], x[k+1]) pair broadcast adds both products into 16
 * fp32 column sums, with no horizontal sums. Up to 6 rows share each weight load; more rows
 * take more passes over a block, from L2.
 *
 * Arithmetic: products and sums in fp32, each column's sum in k order, the bias added in fp32,
 * one rounding to bf16 at the store. That is oneDNN's order too; its results differ from these
 * in about one value in 50,000 (its blocking of long sums). Without AVX512-BF16 the same loops
 * run on widened values with fp32 FMAs (tests, other CPUs: kernels/linear_cpu.py routes
 * layers here only where the fast path was built).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "ae_kernels.h"
#include "linear.h"
#include "pool.h"
#include "bf16.h"
#include "fast_exp.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK AE_LINEAR_BLOCK /* output columns per packed block */
#define MAX_ROWS 6 /* rows per pass over a block: 6 x 4 fp32 sums fill 24 of the 32 registers */
/* Software prefetch this far ahead of the loads. Each layer's weight is a fresh stream, and
 * the hardware prefetcher ramps up at each 4 KB page: measured on SmolLM2's shapes, one-row
 * products of 30 layers took 4.7 ms without it, 4.3-4.4 ms at 1-8 KB ahead. */
#define PREFETCH_BYTES 4096

/* res[r][0..63] = sum over k-pairs p < P of the block's 64 columns times row r's pair p, for
 * R rows. wb: the block's first pair (64 columns x 2 k; the next pair follows at once).
 * xp: row r's k-pairs at xp + r * ldx, as 32-bit words (bf16 k even low, k odd high). */
#ifdef __AVX512BF16__
#define DEFINE_BLOCK(R)                                                                        \
    static inline void block_##R(const uint16_t *wb, int64_t P, const uint32_t *xp,            \
                                 int64_t ldx, float *restrict res, const char *pf,             \
                                 int64_t pf_step, int pf_lines) {                              \
        __m512 acc[R][4];                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();                        \
        for (int64_t p = 0; p < P; p++) {                                                       \
            const uint16_t *w = wb + p * 2 * BLOCK;                                             \
            for (int l = 0; l < pf_lines; l++)                                                  \
                __builtin_prefetch(pf + p * pf_step + 64 * l, 0, 2);                            \
            __m512bh wv[4];                                                                     \
            for (int i = 0; i < 4; i++) wv[i] = (__m512bh)_mm512_loadu_si512(w + 32 * i);       \
            for (int r = 0; r < R; r++) {                                                       \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[r * ldx + p]);          \
                for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[i], xb); \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(res + r * BLOCK + 16 * i, acc[r][i]);  \
    }
#else
/* Portable: each 32-bit word of the weight is one column's (k even, k odd) pair. */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
#define DEFINE_BLOCK(R)                                                                        \
    static inline void block_##R(const uint16_t *wb, int64_t P, const uint32_t *xp,            \
                                 int64_t ldx, float *restrict res, const char *pf,             \
                                 int64_t pf_step, int pf_lines) {                              \
        (void)pf, (void)pf_step, (void)pf_lines;                                                \
        v16f acc[R][4];                                                                         \
        for (int r = 0; r < R; r++)                                                             \
            for (int i = 0; i < 4; i++) acc[r][i] = (v16f){0};                                  \
        for (int64_t p = 0; p < P; p++) {                                                       \
            for (int i = 0; i < 4; i++) {                                                       \
                v16u32 u;                                                                       \
                memcpy(&u, wb + p * 2 * BLOCK + 32 * i, sizeof u);                              \
                const v16u32 lo = u << 16, hi = u & 0xffff0000u;                                \
                v16f w_even, w_odd;                                                             \
                memcpy(&w_even, &lo, sizeof w_even);                                            \
                memcpy(&w_odd, &hi, sizeof w_odd);                                              \
                for (int r = 0; r < R; r++) {                                                   \
                    const uint32_t x = xp[r * ldx + p];                                         \
                    acc[r][i] += w_odd * bf16_to_f32((uint16_t)(x >> 16));                      \
                    acc[r][i] += w_even * bf16_to_f32((uint16_t)x);                             \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int i = 0; i < 4; i++) memcpy(res + r * BLOCK + 16 * i, &acc[r][i], 64);       \
    }
#endif

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)

/* 1 where the vdpbf16ps path was built (else the portable one runs). */
int ae_linear_bf16_fast(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* res[m][0..63] = the fp32 sums of one packed block's 64 columns for all M rows (xp: the rows
 * as k-pairs, P of them each). Passes of up to MAX_ROWS rows: the first reads the block's
 * weights from memory, the later ones from L2. */
void ae_block_sums(const char *wb, int64_t P, const uint32_t *xp, int64_t M,
                   float *restrict res) {
    const int64_t pair_bytes = 2 * BLOCK * 2, block_bytes = P * pair_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        const uint32_t *xr = xp + m0 * P;
        float *rr = res + m0 * BLOCK;
        /* Prefetch: the first pass streams the block from memory, a pair's 4 lines
         * PREFETCH_BYTES ahead of each pair; each later pass (the block now in L2) requests one
         * line of the next block in memory per pair, the lines after those the pass before
         * requested, so that block comes in while this one is computed instead of at the next
         * block's first pass. */
        const char *pf = wb + PREFETCH_BYTES;
        int64_t step = pair_bytes;
        int lines = 4;
        if (m0 > 0) {
            const int64_t done = (m0 / MAX_ROWS - 1) * P * 64; /* bytes requested */
            pf = wb + block_bytes + done;
            step = 64;
            lines = done < block_bytes ? 1 : 0;
        }
        const uint16_t *wv = (const uint16_t *)wb;
        if (rows == 6) block_6(wv, P, xr, P, rr, pf, step, lines);
        else if (rows == 5) block_5(wv, P, xr, P, rr, pf, step, lines);
        else if (rows == 4) block_4(wv, P, xr, P, rr, pf, step, lines);
        else if (rows == 3) block_3(wv, P, xr, P, rr, pf, step, lines);
        else if (rows == 2) block_2(wv, P, xr, P, rr, pf, step, lines);
        else block_1(wv, P, xr, P, rr, pf, step, lines);
    }
}

/* x's M rows as k-pairs, zero padded to Kp (an odd K's last pair must not read past a row),
 * into `xp` (M * P words). */
static void fill_pairs(uint32_t *xp, const void *x, int64_t x_st, int64_t M, int64_t K,
                       int64_t P) {
    for (int64_t m = 0; m < M; m++) {
        memcpy(xp + m * P, (const uint16_t *)x + m * x_st, (size_t)K * 2);
        if (2 * P > K) memset((uint16_t *)(xp + m * P) + K, 0, (size_t)(2 * P - K) * 2);
    }
}

/* The rows as pairs where the kernels' threads read them: the pool's buffer when the caller
 * holds the pool (`pooled`), else a fresh one for the caller to free. */
uint32_t *ae_rows_as_pairs(int pooled, const void *x, int64_t x_st, int64_t M, int64_t K,
                           int64_t P) {
    const size_t bytes = (size_t)(M * P) * sizeof(uint32_t);
    uint32_t *xp = pooled ? ae_pool_buffer(0, bytes) : malloc(bytes);
    if (xp == NULL) abort(); /* a few KB: no way on without it */
    fill_pairs(xp, x, x_st, M, K, P);
    return xp;
}

/* This thread's scratch of at least `floats` floats (it only grows; kept for the thread's
 * life): a few KB for the products' items, up to about a MB for quant_gemm.c's panels of a
 * long prefill chunk. */
float *ae_thread_scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t size;
    if (floats > size) {
        float *grown = realloc(buf, floats * sizeof(float));
        if (grown == NULL) abort(); /* an item has no way on without it */
        buf = grown;
        size = floats;
    }
    return buf;
}

/* Block b's outputs: its column sums (res, [M][64]) plus bias, rounded to bf16, into out's
 * columns b * 64 .. (N the product's width, o_st out's row stride). */
static void store_block(const float *res, int64_t M, int64_t b, int64_t N, const void *bias,
                        void *out, int64_t o_st) {
    const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
    for (int64_t r = 0; r < M; r++) {
        uint16_t *o = (uint16_t *)out + r * o_st + n0;
        for (int64_t c = 0; c < cols; c++) {
            float v = res[r * BLOCK + c];
            if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n0 + c]);
            o[c] = f32_to_bf16(v);
        }
    }
}

/* Threads for `items` items: one item each at least. */
static int team_size(int64_t items, int num_threads) {
    return items < num_threads ? (int)items : num_threads;
}

/* Whether a product of M rows runs on the pool (pool.c): decode-sized ones, whose steps are
 * short enough that a preempted thread would stall them; the caller then holds the pool and
 * must release it. Larger ones run on OpenMP, a static split as the pool's shares are: their
 * steps are long, and there the pool measured 5-10% slower (batches of 16-64 rows). */
int ae_linear_use_pool(int64_t M, int num_threads) {
    return num_threads > 1 && M <= AE_POOL_MAX_ROWS && ae_pool_acquire();
}

/* fn(ctx, item, commit) for every item < n: on the pool where the caller holds it (`pooled`),
 * else in an OpenMP team of up to num_threads, each thread a contiguous range of items. */
void ae_linear_run_items(int pooled, ae_pool_fn fn, const void *ctx, size_t ctx_bytes,
                         int64_t n, int num_threads) {
    const int team = team_size(n, num_threads);
    if (pooled) {
        ae_pool_run(fn, ctx, ctx_bytes, n, team);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t i = 0; i < n; i++) {
        const struct ae_commit alone = {0, i};
        fn(ctx, i, &alone);
    }
}

/* A product on the pool (pool.h): item i is `per_item` consecutive 64-column blocks. */
struct product_job {
    const uint32_t *xp;
    int64_t P, M, N, o_st, per_item;
    const void *w, *bias;
    void *out;
};

static void product_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct product_job *j = ctx;
    const int64_t blocks = (j->N + BLOCK - 1) / BLOCK, block_bytes = j->P * 2 * BLOCK * 2;
    const int64_t b0 = item * j->per_item;
    const int64_t b1 = b0 + j->per_item < blocks ? b0 + j->per_item : blocks;
    float *res = ae_thread_scratch((size_t)((b1 - b0) * j->M * BLOCK));
    for (int64_t b = b0; b < b1; b++)
        ae_block_sums((const char *)j->w + b * block_bytes, j->P, j->xp, j->M,
                   res + (b - b0) * j->M * BLOCK);
    if (!ae_commit_begin(commit)) return; /* another thread committed this item */
    for (int64_t b = b0; b < b1; b++)
        store_block(res + (b - b0) * j->M * BLOCK, j->M, b, j->N, j->bias, j->out, j->o_st);
    ae_commit_end(commit);
}

/* Items of one block each, unless there are more blocks than the pool shares out at once. */
static int64_t blocks_per_item(int64_t blocks) {
    return blocks <= AE_POOL_MAX_ITEMS ? 1 : (blocks + AE_POOL_MAX_ITEMS - 1) / AE_POOL_MAX_ITEMS;
}

/* The product x @ W^T + bias into out, over the rows as pairs (xp): see ae_linear_run_items. */
static void run_product(int pooled, const uint32_t *xp, int64_t P, int64_t M, const void *w,
                        int64_t N, const void *bias, void *out, int64_t o_st, int num_threads) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, per_item = blocks_per_item(blocks);
    const int64_t items = (blocks + per_item - 1) / per_item;
    const struct product_job job = {xp, P, M, N, o_st, per_item, w, bias, out};
    ae_linear_run_items(pooled, product_item, &job, sizeof job, items, num_threads);
}

/*
 * out[m][n] = sum_k x[m][k] * W[n][k] + bias[n], for m < M, n < N; bf16 throughout.
 * x: [M][K] with row stride x_st (elements); w: the packed weight described at the top, Kp
 * the packed k extent (even, >= K); bias: N values or NULL; out: [M][N], row stride o_st.
 * Work is split over the 64-column blocks: claimed one at a time by the pool's threads for up
 * to AE_POOL_MAX_ROWS rows (pool.c: no thread waits for one that was preempted), else a
 * contiguous range per OpenMP thread (see ae_linear_use_pool).
 */
void ae_linear_bf16(const void *x, int64_t x_st, int64_t M, const void *w, int64_t N, int64_t K,
                    int64_t Kp, const void *bias, void *out, int64_t o_st, int num_threads) {
    const int64_t P = Kp / 2;
    const int pooled = ae_linear_use_pool(M, num_threads);
    uint32_t *xp = ae_rows_as_pairs(pooled, x, x_st, M, K, P);
    run_product(pooled, xp, P, M, w, N, bias, out, o_st, num_threads);
    if (pooled) ae_pool_release();
    else free(xp);
}

/* The gated MLP's first half on the pool: item j is gate block j with up block j. */
struct silu_job {
    const uint32_t *xp;
    int64_t P, M, inter, o_st;
    const void *w, *bias;
    void *out;
};

static void silu_item(const void *ctx, int64_t j, const struct ae_commit *commit) {
    const struct silu_job *s = ctx;
    const int64_t block_bytes = s->P * 2 * BLOCK * 2, pairs = s->inter / BLOCK;
    float *gate = ae_thread_scratch((size_t)(2 * s->M * BLOCK));
    float *up = gate + s->M * BLOCK;
    ae_block_sums((const char *)s->w + j * block_bytes, s->P, s->xp, s->M, gate);
    ae_block_sums((const char *)s->w + (pairs + j) * block_bytes, s->P, s->xp, s->M, up);
    const int64_t n0 = j * BLOCK;
    for (int64_t r = 0; r < s->M; r++) {
        float *g = gate + r * BLOCK, *u = up + r * BLOCK;
        for (int64_t c = 0; c < BLOCK; c++) {
            g[c] = ae_product_value(g + c, s->bias, n0 + c);
            u[c] = ae_product_value(u + c, s->bias, s->inter + n0 + c);
        }
#pragma omp simd
        for (int64_t c = 0; c < BLOCK; c++) g[c] = silu_f32(g[c]);
        for (int64_t c = 0; c < BLOCK; c++) g[c] = bf16_to_f32(f32_to_bf16(g[c])) * u[c];
    }
    if (!ae_commit_begin(commit)) return;
    for (int64_t r = 0; r < s->M; r++) {
        uint16_t *o = (uint16_t *)s->out + r * s->o_st + n0;
        for (int64_t c = 0; c < BLOCK; c++) o[c] = f32_to_bf16(gate[r * BLOCK + c]);
    }
    ae_commit_end(commit);
}

/*
 * A gated MLP's first half for decode-sized batches: out[m][i] = silu(g) * u, with g and u
 * columns i and I + i of the product x @ W^T + bias (W the joint [gate; up] weight, N = 2I
 * rows, I a multiple of 64), each rounded to bf16 as the product would store it, silu in fp32
 * rounded to bf16, the product rounded again: ae_linear_bf16 then ae_silu_mul's numbers, bit
 * for bit, without the [M][2I] intermediate or a second call. Each item is a column block j:
 * block j (gate) and block j + I/64 (up) together. out: [M][I], row stride o_st.
 */
void ae_linear_silu_bf16(const void *x, int64_t x_st, int64_t M, const void *w, int64_t N,
                         int64_t K, int64_t Kp, const void *bias, void *out, int64_t o_st,
                         int num_threads) {
    const int64_t P = Kp / 2, inter = N / 2, pairs = inter / BLOCK;
    const int pooled = pairs <= AE_POOL_MAX_ITEMS && ae_linear_use_pool(M, num_threads);
    uint32_t *xp = ae_rows_as_pairs(pooled, x, x_st, M, K, P);
    const struct silu_job job = {xp, P, M, inter, o_st, w, bias, out};
    ae_linear_run_items(pooled, silu_item, &job, sizeof job, pairs, num_threads);
    if (pooled) ae_pool_release();
    else free(xp);
}

/* The norm rows after the product, on the pool: item r is row r, computed in the thread's
 * scratch from the residual row as it was, then stored (residual and out) on commit. */
struct norm_job {
    const void *product, *residual_in, *norm_weight; /* read: [M][N], [M][res_in_st] */
    void *residual, *out;                             /* written on commit */
    int64_t N, res_in_st, r_st, o_st;
    float eps;
};

static void norm_item(const void *ctx, int64_t r, const struct ae_commit *commit) {
    const struct norm_job *j = ctx;
    const int64_t N = j->N;
    float *wn = ae_thread_scratch((size_t)(4 * N));
    float *buf = wn + N, *other = buf + N;
    uint16_t *res = (uint16_t *)(other + N), *out = res + N; /* N bf16 each: the last N floats */
    for (int64_t i = 0; i < N; i++) wn[i] = bf16_to_f32(((const uint16_t *)j->norm_weight)[i]);
    memcpy(res, (const uint16_t *)j->residual_in + r * j->res_in_st, (size_t)N * 2);
    ae_add_rms_norm_row(AE_BF16, (const uint16_t *)j->product + r * N, N, res, N, out, N, wn,
                        buf, other, 0, N, j->eps);
    if (!ae_commit_begin(commit)) return;
    memcpy((uint16_t *)j->residual + r * j->r_st, res, (size_t)N * 2);
    memcpy((uint16_t *)j->out + r * j->o_st, out, (size_t)N * 2);
    ae_commit_end(commit);
}

/*
 * A pre-norm decoder's projection into the residual stream and the norm after it, for
 * decode-sized batches: product = x @ W^T + bias (as ae_linear_bf16, into `product`, [M][N]
 * scratch), then `residual += product; out = RMSNorm(residual) * norm_weight` per row
 * (norms.c's ae_add_rms_norm_row), in one call instead of two: both on the pool (see
 * ae_linear_use_pool), else in one OpenMP region whose threads norm the rows after
 * their columns. Same numbers as the two calls, bit for bit. residual: [M][N], row stride
 * r_st, updated in place; out: [M][N], row stride o_st.
 */
void ae_linear_add_rms_norm_bf16(const void *x, int64_t x_st, int64_t M, const void *w,
                                 int64_t N, int64_t K, int64_t Kp, const void *bias,
                                 void *product, void *residual, int64_t r_st,
                                 const void *norm_weight, float eps, void *out, int64_t o_st,
                                 int num_threads) {
    const int64_t P = Kp / 2;
    const int pooled = ae_linear_use_pool(M, num_threads);
    uint32_t *xp = ae_rows_as_pairs(pooled, x, x_st, M, K, P);
    if (!pooled) { /* one OpenMP region: each thread its blocks, then its rows' norms */
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, per_item = blocks_per_item(blocks);
        const int64_t items = (blocks + per_item - 1) / per_item;
        const struct product_job pj = {xp, P, M, N, N, per_item, w, bias, product};
        const int team = team_size(items, num_threads);
#pragma omp parallel num_threads(team) if (team > 1)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < items; i++) {
                const struct ae_commit alone = {0, i};
                product_item(&pj, i, &alone);
            } /* (the loop's barrier: every column of every row is in `product`) */
            float *wn = malloc((size_t)N * sizeof(float));
            float *buf = malloc((size_t)N * sizeof(float));
            float *other = malloc((size_t)N * sizeof(float));
            for (int64_t i = 0; i < N; i++)
                wn[i] = bf16_to_f32(((const uint16_t *)norm_weight)[i]);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                ae_add_rms_norm_row(AE_BF16, product, N, residual, r_st, out, o_st, wn, buf,
                                    other, r, N, eps);
            free(wn);
            free(buf);
            free(other);
        }
        free(xp);
        return;
    }
    run_product(pooled, xp, P, M, w, N, bias, product, N, num_threads);
    /* The norm's helpers read the product and the residual rows from the pool's own copies
     * (a helper preempted inside an item may read on after this call returned). */
    const void *product_in = product, *residual_in = residual;
    int64_t res_in_st = r_st;
    if (M > 1) {
        const size_t bytes = (size_t)(M * N) * 2;
        uint16_t *p_copy = ae_pool_buffer(1, bytes), *r_copy = ae_pool_buffer(2, bytes);
        if (p_copy == NULL || r_copy == NULL) abort();
        memcpy(p_copy, product, bytes);
        for (int64_t r = 0; r < M; r++)
            memcpy(r_copy + r * N, (const uint16_t *)residual + r * r_st, (size_t)N * 2);
        product_in = p_copy, residual_in = r_copy, res_in_st = N;
    }
    const struct norm_job job = {product_in, residual_in, norm_weight, residual, out,
                                 N, res_in_st, r_st, o_st, eps};
    ae_linear_run_items(1, norm_item, &job, sizeof job, M, num_threads);
    ae_pool_release();
}
