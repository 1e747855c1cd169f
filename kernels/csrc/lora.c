/*
 * LoRA's low-rank add on a step's rows (ae_lora_add): Punica's shrink and expand (vLLM's
 * sgmv/bgmv) on the CPU, for the lean forward's projections (decode_layers.c calls it after
 * each product; kernels/lora.py binds it and holds its torch reference).
 *
 * A step's rows belong to requests for different adapters and to none. The rows of one adapter
 * are a segment; each segment has a descriptor (enum ae_lora_field) of its adapter's weights
 * for one group of projections that read the same input (q/k/v, o, gate/up, down):
 *
 *   A   [R, K]      the parts' lora_A stacked (R = the sum of their ranks)
 *   B_p [r_p, N_p]  part p's lora_B transposed and times the adapter's scale (NULL: p not
 *                   adapted), reading the shrink's columns lo_p .. lo_p + r_p
 *
 * and   y[row, col_p + j] += round((x[row] @ A^T)[lo_p : lo_p + r_p] @ B_p[:, j])
 *
 * for every row of the segment, part p and column j < N_p: the products in fp32 (x widened
 * from its dtype, the weights fp32 or bf16), the delta rounded to y's dtype, then added and
 * rounded again, as the reference's `out += delta.to(out.dtype)`. Rows of no segment are
 * untouched.
 *
 * Work: the shrink in items of (segment, 8 rows of A), each row of A read once for all of the
 * segment's rows; then the expand in items of (segment, part, 64 columns), each B block read
 * once for all of them. So each adapter's weights are read once per call, however many rows
 * use it. The items run on the work pool (pool.c) where the caller can hold it, else on
 * OpenMP, and calls of little work in the calling thread; every way sums in the same order
 * (block_end), so the numbers do not depend on the thread count. The inner loops are 16-lane
 * fp32 vectors (ae_vec.h's v16f: one AVX-512 register, two AVX2 ones, or scalar code on other
 * builds) with FMAs where the build has them.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ae_kernels.h"
#include "ae_vec.h"
#include "linear.h"
#include "pool.h"

#define SHRINK_ROWS 8 /* rows of A per shrink item */
#define COLS 64       /* columns of B per expand item: four 16-lane accumulators */
/* Below this many multiply-adds a call runs in the calling thread: a job's or a team's start
 * costs more than the work (a one-row rank-16 q/k/v shrink and expand is ~43k). */
#define PARALLEL_MIN_WORK 32768

/* 16 weights of dtype wdt (AE_F32 or AE_BF16) at element i of w, as fp32 lanes. */
static ALWAYS_INLINE v16f load16_w(const void *w, int64_t i, int wdt) {
    return load16_as_f32((const char *)w + i * elem_size(wdt), wdt);
}

static ALWAYS_INLINE float load1_w(const void *w, int64_t i, int wdt) {
    return wdt == AE_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

/* The sum of v's lanes (one order per build: every path of a build sums alike). */
static ALWAYS_INLINE float hsum16(v16f v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* sh[m * ld + r - rb] = xf[m] . A[r] for the segment's n rows (xf dense [n][K]) and rows
 * r0 .. r1 of A; four rows of A at a time share each load of x. For several rows, bf16 rows
 * of A are widened once into aw [4][K] (the same values: the same sums). */
static void shrink(const float *xf, int64_t n, int64_t K, const void *a_, int wdt_, int64_t r0,
                   int64_t r1, float *sh, int64_t ld, int64_t rb, float *aw) {
    const int64_t kv = K - K % LANES;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const void *a = a_;
        int wdt = wdt_;
        int64_t base = 0; /* A's row r + i is row r + base + i of `a` */
        if (wdt != AE_F32 && n > 1) {
            load_f32((const char *)a_ + r * K * elem_size(wdt), aw, 4 * K, wdt);
            a = aw, wdt = AE_F32, base = -r;
        }
        for (int64_t m = 0; m < n; m++) {
            const float *x = xf + m * K;
            v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < kv; k += LANES) {
                const v16f xv = load16(x + k);
                a0 += xv * load16_w(a, (r + base) * K + k, wdt);
                a1 += xv * load16_w(a, (r + base + 1) * K + k, wdt);
                a2 += xv * load16_w(a, (r + base + 2) * K + k, wdt);
                a3 += xv * load16_w(a, (r + base + 3) * K + k, wdt);
            }
            float s[4] = {hsum16(a0), hsum16(a1), hsum16(a2), hsum16(a3)};
            for (int64_t i = 0; i < 4; i++) {
                for (int64_t k = kv; k < K; k++) s[i] += x[k] * load1_w(a, (r + base + i) * K + k, wdt);
                sh[m * ld + r + i - rb] = s[i];
            }
        }
    }
    for (; r < r1; r++) {
        for (int64_t m = 0; m < n; m++) {
            const float *x = xf + m * K;
            v16f acc = {0};
            for (int64_t k = 0; k < kv; k += LANES)
                acc += load16(x + k) * load16_w(a_, r * K + k, wdt_);
            float s = hsum16(acc);
            for (int64_t k = kv; k < K; k++) s += x[k] * load1_w(a_, r * K + k, wdt_);
            sh[m * ld + r - rb] = s;
        }
    }
}

/* The delta of one row's nc (<= COLS) columns, rounded to y's dtype and added to them. */
static ALWAYS_INLINE void add_delta(float *restrict delta, int64_t nc, int dt, char *yp) {
    float out[COLS];
    round_row(delta, nc, dt); /* the delta in y's dtype, as the reference's .to(out.dtype) */
    load_f32(yp, out, nc, dt);
    for (int64_t c = 0; c < nc; c++) out[c] += delta[c];
    store_f32(yp, out, nc, dt);
}

/* Where the sum over A's rows that starts at part row r breaks: every SHRINK_ROWS rows of A
 * (the shrink's items) are summed apart, from zero, and the blocks' sums added in order. */
static ALWAYS_INLINE int64_t block_end(int64_t lo, int64_t r, int64_t rank) {
    const int64_t e = r + SHRINK_ROWS - (lo + r) % SHRINK_ROWS;
    return e < rank ? e : rank;
}

/* sums[m][0 .. nc] = sh[m][lo:lo + rank] @ B[:, c0:c0 + nc] for the segment's n rows (nc <=
 * COLS; B [rank][N] of dtype wdt). Whole blocks of COLS columns run two rows at a time in
 * eight accumulators, each load of B serving both. */
static void expand_sums(const float *sh, int64_t ld, int64_t n, const void *b, int wdt,
                        int64_t lo, int64_t rank, int64_t N, int64_t c0, int64_t nc,
                        float *sums, float *bw) {
    if (wdt != AE_F32 && n > 2) { /* bf16 B read by many rows: widened once into bw [rank][COLS] */
        for (int64_t r = 0; r < rank; r++)
            load_f32((const char *)b + (r * N + c0) * elem_size(wdt), bw + r * COLS, nc, wdt);
        b = bw, wdt = AE_F32, N = COLS, c0 = 0;
    }
    int64_t m = 0;
    if (nc == COLS) {
        for (; m + 2 <= n; m += 2) {
            const float *s0 = sh + m * ld + lo, *s1 = s0 + ld;
            v16f t[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
            for (int64_t ra = 0, re; ra < rank; ra = re) {
                re = block_end(lo, ra, rank);
                v16f p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                v16f q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
                for (int64_t r = ra; r < re; r++) {
                    const int64_t at = r * N + c0;
                    const v16f b0 = load16_w(b, at, wdt), b1 = load16_w(b, at + 16, wdt);
                    const v16f b2 = load16_w(b, at + 32, wdt), b3 = load16_w(b, at + 48, wdt);
                    const float u = s0[r], v = s1[r];
                    p0 += u * b0, p1 += u * b1, p2 += u * b2, p3 += u * b3;
                    q0 += v * b0, q1 += v * b1, q2 += v * b2, q3 += v * b3;
                }
                t[0] += p0, t[1] += p1, t[2] += p2, t[3] += p3;
                t[4] += q0, t[5] += q1, t[6] += q2, t[7] += q3;
            }
            memcpy(sums + m * COLS, t, sizeof t);
        }
    }
    const int64_t full = nc - nc % LANES;
    for (; m < n; m++) { /* the last odd row, or a block narrower than COLS */
        const float *s = sh + m * ld + lo;
        v16f t[COLS / LANES] = {{0}, {0}, {0}, {0}};
        float tail[LANES] = {0};
        for (int64_t ra = 0, re; ra < rank; ra = re) {
            re = block_end(lo, ra, rank);
            for (int64_t c = 0; c < full; c += LANES) {
                v16f acc = {0};
                for (int64_t r = ra; r < re; r++) acc += s[r] * load16_w(b, r * N + c0 + c, wdt);
                t[c / LANES] += acc;
            }
            for (int64_t c = full; c < nc; c++) {
                float acc = 0.0f;
                for (int64_t r = ra; r < re; r++) acc += s[r] * load1_w(b, r * N + c0 + c, wdt);
                tail[c - full] += acc;
            }
        }
        memcpy(sums + m * COLS, t, (size_t)full * sizeof(float));
        memcpy(sums + m * COLS + full, tail, (size_t)(nc - full) * sizeof(float));
    }
}

/* A segment's shrink by A's rows r0 .. r0 + SHRINK_ROWS (of its descriptor d), from its n
 * rows of x (dense [n][K], dtype dt; widened into xf [n][K]) into sh_out [n][ld] (columns
 * r - r0; aw: shrink's). Returns how many of A's rows it took (0: none are left). */
static int64_t shrink_item(const char *x, int64_t n, int64_t K, int dt, const int64_t *d,
                           int64_t r0, float *xf, float *sh_out, int64_t ld, float *aw) {
    const int64_t rank = d[AE_LORA_A] ? d[AE_LORA_RANK] : 0;
    const int64_t r1 = r0 + SHRINK_ROWS < rank ? r0 + SHRINK_ROWS : rank;
    if (r0 >= r1) return 0;
    load_f32(x, xf, n * K, dt);
    shrink(xf, n, K, (const void *)d[AE_LORA_A], (int)d[AE_LORA_WDT], r0, r1, sh_out, ld, r0, aw);
    return r1 - r0;
}

/*
 * On the work pool (pool.c), whose caller never waits for a preempted thread: a call runs as
 * two jobs, the shrink in items of (segment, SHRINK_ROWS rows of A) into the
 * pool's buffer, then the expand in items of (segment, part, COLS columns), each adding its
 * rows' deltas to y. Every item computes into the thread's own memory and stores only once
 * its commit is won (pool.h). Everything an item reads stays mapped after the job (pool.c's
 * contract): x's rows are copied into the pool's buffer, the segments and their descriptors'
 * addresses are in the job's context (copied with it), y and the row indices are read only
 * after a won commit (the job is still on), and the weights and descriptors are the adapter's,
 * which model/lora_layers.py frees only after ae_pool_quiesce.
 */
#define POOL_SEGS 6 /* the most segments a job's context holds */

struct segs {
    int64_t first[POOL_SEGS], count[POOL_SEGS];
    const int64_t *desc[POOL_SEGS];
};

struct shrink_job {
    const char *x; /* the segments' rows, gathered in order, dtype dt */
    float *sh;     /* [M][ld] */
    int64_t ld, K, dt, per_seg;
    struct segs segs;
};

static void shrink_pool_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct shrink_job *j = ctx;
    const int64_t s = item / j->per_seg, r0 = item % j->per_seg * SHRINK_ROWS;
    const int64_t n = j->segs.count[s], first = j->segs.first[s];
    float *xf = ae_thread_scratch((size_t)((n + 4) * j->K + n * SHRINK_ROWS));
    float *aw = xf + n * j->K, *out = aw + 4 * j->K;
    const int64_t done = shrink_item(j->x + first * j->K * elem_size((int)j->dt), n, j->K,
                                     (int)j->dt, j->segs.desc[s], r0, xf, out, SHRINK_ROWS, aw);
    if (!ae_commit_begin(commit)) return; /* another thread committed this item */
    for (int64_t m = 0; m < n && done; m++)
        memcpy(j->sh + (first + m) * j->ld + r0, out + m * SHRINK_ROWS,
               (size_t)done * sizeof(float));
    ae_commit_end(commit);
}

_Static_assert(sizeof(struct shrink_job) <= 256, "pool.h: a job's context is at most 256 bytes");

struct expand_job {
    const float *sh; /* [M][ld] */
    char *y;
    const int64_t *rows; /* y's rows of the segments, in order */
    int64_t ld, y_st, dt, num_parts, per_seg;
    int64_t cols[3], widths[3];
    struct segs segs;
};

static void expand_pool_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct expand_job *j = ctx;
    const int64_t s = item / j->per_seg;
    int64_t p = 0, c0 = item % j->per_seg * COLS; /* which part's which columns */
    while (p + 1 < j->num_parts && c0 >= (j->widths[p] + COLS - 1) / COLS * COLS)
        c0 -= (j->widths[p++] + COLS - 1) / COLS * COLS;
    const int64_t *d = j->segs.desc[s], *part = d + AE_LORA_B0 + 3 * p;
    const int64_t n = j->segs.count[s], first = j->segs.first[s], width = j->widths[p];
    const int64_t nc = width - c0 < COLS ? width - c0 : COLS;
    const int run = d[AE_LORA_A] != 0 && part[0] != 0;
    float *sums = ae_thread_scratch((size_t)((n + (run ? part[2] : 0)) * COLS));
    if (run)
        expand_sums(j->sh + first * j->ld, j->ld, n, (const void *)part[0], (int)d[AE_LORA_WDT],
                    part[1], part[2], width, c0, nc, sums, sums + n * COLS);
    if (!ae_commit_begin(commit)) return;
    const int64_t es = elem_size((int)j->dt);
    for (int64_t m = 0; m < n && run; m++)
        add_delta(sums + m * COLS, nc, (int)j->dt,
                  j->y + (j->rows[first + m] * j->y_st + j->cols[p] + c0) * es);
    ae_commit_end(commit);
}

_Static_assert(sizeof(struct expand_job) <= 256, "pool.h: a job's context is at most 256 bytes");

/* ae_lora_add on the pool, which the caller holds. -1 when out of memory. */
static int lora_add_pool(int dt, const void *x, int64_t x_st, void *y, int64_t y_st, int64_t K,
                         int64_t num_parts, const int64_t *part_cols,
                         const int64_t *part_widths, const int64_t *rows,
                         const int64_t *seg_rows, int64_t num_segs, const int64_t *descs,
                         int64_t desc_offset, int64_t max_rank, int num_threads) {
    struct segs segs = {{0}, {0}, {0}};
    for (int64_t s = 0; s < num_segs; s++) {
        segs.first[s] = seg_rows[s], segs.count[s] = seg_rows[s + 1] - seg_rows[s];
        segs.desc[s] = (const int64_t *)descs[s] + desc_offset;
    }
    const int64_t M = seg_rows[num_segs], es = elem_size(dt);
    char *xs = ae_pool_buffer(0, (size_t)(M * K * es));
    float *sh = ae_pool_buffer(1, (size_t)(M * max_rank) * sizeof(float));
    if (xs == NULL || sh == NULL) return -1;
    for (int64_t m = 0; m < M; m++)
        memcpy(xs + m * K * es, (const char *)x + rows[m] * x_st * es, (size_t)(K * es));
    const int64_t per_seg = (max_rank + SHRINK_ROWS - 1) / SHRINK_ROWS;
    const struct shrink_job sj = {xs, sh, max_rank, K, dt, per_seg, segs};
    int64_t items = per_seg * num_segs;
    ae_pool_run(shrink_pool_item, &sj, sizeof sj, items, items < num_threads ? (int)items : num_threads);
    struct expand_job ej = {sh, y, rows, max_rank, y_st, dt, num_parts, 0, {0}, {0}, segs};
    for (int64_t p = 0; p < num_parts; p++) {
        ej.cols[p] = part_cols[p], ej.widths[p] = part_widths[p];
        ej.per_seg += (part_widths[p] + COLS - 1) / COLS;
    }
    items = ej.per_seg * num_segs;
    ae_pool_run(expand_pool_item, &ej, sizeof ej, items, items < num_threads ? (int)items : num_threads);
    return 0;
}

/*
 * y += each segment's low-rank product (see the top of this file). x [T][K] and y of dtype
 * dt (AE_F32 or AE_BF16; row strides x_st, y_st); the parts' columns of y start at
 * part_cols[p] and are part_widths[p] wide (p < num_parts <= 3). rows [seg_rows[num_segs]]
 * (int64) lists the segments' rows: segment s is rows[seg_rows[s] .. seg_rows[s + 1]], each
 * row in at most one segment. Segment s's descriptor is the AE_LORA_FIELDS int64 at
 * (const int64_t *)descs[s] + desc_offset; one whose A is 0 adds nothing. 0 on success, -1
 * when out of memory (y then untouched), -2 for a bad descriptor or part count.
 */
int ae_lora_add(int dt, const void *x, int64_t x_st, void *y, int64_t y_st, int64_t K,
                int64_t num_parts, const int64_t *part_cols, const int64_t *part_widths,
                const int64_t *rows, const int64_t *seg_rows, int64_t num_segs,
                const int64_t *descs, int64_t desc_offset, int num_threads) {
    if (num_parts < 1 || num_parts > 3 || (dt != AE_F32 && dt != AE_BF16)) return -2;
    const int64_t M = num_segs > 0 ? seg_rows[num_segs] : 0;
    if (M <= 0) return 0;
    /* The segments' descriptors, their widest shrink, and how many items of each kind. */
    int64_t max_rank = 0, shrink_items = 0, expand_items = 0, work = 0;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t *d = (const int64_t *)descs[s] + desc_offset;
        if (d[AE_LORA_A] == 0) continue;
        const int64_t rank = d[AE_LORA_RANK], n = seg_rows[s + 1] - seg_rows[s];
        if (rank <= 0 || (d[AE_LORA_WDT] != AE_F32 && d[AE_LORA_WDT] != AE_BF16)) return -2;
        max_rank = rank > max_rank ? rank : max_rank;
        shrink_items += (rank + SHRINK_ROWS - 1) / SHRINK_ROWS;
        work += n * rank * K;
        for (int64_t p = 0; p < num_parts; p++) {
            const int64_t *part = d + AE_LORA_B0 + 3 * p; /* B, lo, rank */
            if (part[0] == 0) continue;
            if (part[1] < 0 || part[2] <= 0 || part[1] + part[2] > rank) return -2;
            expand_items += (part_widths[p] + COLS - 1) / COLS;
            work += n * part[2] * part_widths[p];
        }
    }
    if (max_rank == 0) return 0;
    /* On the pool where the caller can hold it, whatever the rows: an OpenMP team waits at
     * each of its barriers for a thread that was preempted, and on 2 cores shared with another
     * busy process that cost whole time slices (64 rows, 4 adapters, SmolLM2's 30 layers: 75
     * to 140 ms a step on OpenMP against 19-20 ms on the pool, measured side by side). */
    if (num_threads > 1 && work >= PARALLEL_MIN_WORK &&
        num_segs <= POOL_SEGS && ae_pool_acquire()) {
        const int status = lora_add_pool(dt, x, x_st, y, y_st, K, num_parts, part_cols,
                                         part_widths, rows, seg_rows, num_segs, descs,
                                         desc_offset, max_rank, num_threads);
        ae_pool_release();
        return status;
    }
    /* Item tables: (segment, first row of A) and (segment, part, first column). */
    int64_t *items = malloc((size_t)(2 * shrink_items + 3 * expand_items) * sizeof(int64_t));
    float *xf = malloc((size_t)(M * K + M * max_rank) * sizeof(float));
    if (items == NULL || xf == NULL) {
        free(items);
        free(xf);
        return -1;
    }
    float *sh = xf + M * K; /* [M][max_rank]: the segments' shrinks */
    int64_t *shrink_at = items, *expand_at = items + 2 * shrink_items, i = 0, j = 0;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t *d = (const int64_t *)descs[s] + desc_offset;
        if (d[AE_LORA_A] == 0) continue;
        for (int64_t r = 0; r < d[AE_LORA_RANK]; r += SHRINK_ROWS, i++)
            shrink_at[2 * i] = s, shrink_at[2 * i + 1] = r;
        for (int64_t p = 0; p < num_parts; p++) {
            if (d[AE_LORA_B0 + 3 * p] == 0) continue;
            for (int64_t c = 0; c < part_widths[p]; c += COLS, j++)
                expand_at[3 * j] = s, expand_at[3 * j + 1] = p, expand_at[3 * j + 2] = c;
        }
    }
    const int64_t es = elem_size(dt);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            load_f32((const char *)x + rows[m] * x_st * es, xf + m * K, K, dt);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < shrink_items; it++) {
            const int64_t s = shrink_at[2 * it], r0 = shrink_at[2 * it + 1];
            const int64_t *d = (const int64_t *)descs[s] + desc_offset;
            const int64_t rank = d[AE_LORA_RANK], first = seg_rows[s];
            const int64_t r1 = r0 + SHRINK_ROWS < rank ? r0 + SHRINK_ROWS : rank;
            shrink(xf + first * K, seg_rows[s + 1] - first, K, (const void *)d[AE_LORA_A],
                   (int)d[AE_LORA_WDT], r0, r1, sh + first * max_rank, max_rank, 0,
                   ae_thread_scratch((size_t)(4 * K)));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < expand_items; it++) {
            const int64_t s = expand_at[3 * it], p = expand_at[3 * it + 1];
            const int64_t c0 = expand_at[3 * it + 2];
            const int64_t *d = (const int64_t *)descs[s] + desc_offset;
            const int64_t *part = d + AE_LORA_B0 + 3 * p, first = seg_rows[s];
            const int64_t width = part_widths[p];
            const int64_t n = seg_rows[s + 1] - first, nc = width - c0 < COLS ? width - c0 : COLS;
            float *sums = ae_thread_scratch((size_t)((n + part[2]) * COLS));
            expand_sums(sh + first * max_rank, max_rank, n, (const void *)part[0],
                        (int)d[AE_LORA_WDT], part[1], part[2], width, c0, nc, sums,
                        sums + n * COLS);
            for (int64_t m = 0; m < n; m++)
                add_delta(sums + m * COLS, nc, dt,
                          (char *)y + (rows[first + m] * y_st + part_cols[p] + c0) * es);
        }
    }
    free(items);
    free(xf);
    return 0;
}
