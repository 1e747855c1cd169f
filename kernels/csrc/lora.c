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
    int64_t c = 0;
    if (dt == AE_BF16) { /* 16 lanes at a time: the same roundings as f32_to_bf16's */
        uint16_t *y = (uint16_t *)yp;
        for (; c + LANES <= nc; c += LANES) {
            const v16f d = round16_bf16(load16(delta + c)); /* the reference's .to(out.dtype) */
            store16_bf16(y + c, load16_as_f32((const char *)(y + c), AE_BF16) + d);
        }
    }
    float out[COLS];
    const int64_t es = elem_size(dt), rest = nc - c;
    round_row(delta + c, rest, dt); /* the delta in y's dtype, as the reference's .to() */
    load_f32(yp + c * es, out, rest, dt);
    for (int64_t i = 0; i < rest; i++) out[i] += delta[c + i];
    store_f32(yp + c * es, out, rest, dt);
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
    if (wdt != AE_F32 && n > 2 && bw) { /* bf16 B read by many rows: widened once, into bw */
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
 * In items (on the work pool, pool.c, whose caller never waits for a preempted thread, or in
 * an OpenMP region): the shrink in items of (segment, SHRINK_ROWS rows of A) into a buffer,
 * then the expand in items of (segment, part, WIDE columns), each adding its rows' deltas to
 * y. Every item computes into the thread's own memory and stores only once
 * its commit is won (pool.h). Everything an item reads stays mapped after the job (pool.c's
 * contract): x's rows are copied into the pool's buffer, the segments and their descriptors'
 * addresses are in the job's context (copied with it), y and the row indices are read only
 * after a won commit (the job is still on), and the weights and descriptors are the adapter's,
 * which worker/lora_manager.py frees only after ae_pool_quiesce.
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

/* An expand item's columns: WIDE of a part (its B rows then read front to back in long runs,
 * which the prefetchers follow, where COLS-column items read 128 bytes a row). */
#define WIDE (8 * COLS)

static void expand_pool_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct expand_job *j = ctx;
    const int64_t s = item / j->per_seg;
    int64_t p = 0, c0 = item % j->per_seg * WIDE; /* which part's which columns */
    while (p + 1 < j->num_parts && c0 >= (j->widths[p] + WIDE - 1) / WIDE * WIDE)
        c0 -= (j->widths[p++] + WIDE - 1) / WIDE * WIDE;
    const int64_t *d = j->segs.desc[s], *part = d + AE_LORA_B0 + 3 * p;
    const int64_t n = j->segs.count[s], first = j->segs.first[s], width = j->widths[p];
    const int64_t nw = width - c0 < WIDE ? width - c0 : WIDE, rank = part[2];
    const int run = d[AE_LORA_A] != 0 && part[0] != 0;
    float *sums = ae_thread_scratch((size_t)(n * WIDE + (run ? rank * WIDE : 0)));
    if (run) {
        const void *b = (const void *)part[0];
        int wdt = (int)d[AE_LORA_WDT];
        int64_t N = width, off = c0;
        if (wdt != AE_F32 && n > 2) { /* bf16 B read by many rows: widened once, row by row */
            float *bw = sums + n * WIDE;
            for (int64_t r = 0; r < rank; r++)
                load_f32((const char *)b + (r * width + c0) * elem_size(wdt), bw + r * nw, nw,
                         wdt);
            b = bw, wdt = AE_F32, N = nw, off = 0;
        }
        for (int64_t cc = 0; cc < nw; cc += COLS)
            expand_sums(j->sh + first * j->ld, j->ld, n, b, wdt, part[1], rank, N, off + cc,
                        nw - cc < COLS ? nw - cc : COLS, sums + cc * n, NULL);
    }
    if (!ae_commit_begin(commit)) return;
    const int64_t es = elem_size((int)j->dt);
    for (int64_t cc = 0; cc < nw && run; cc += COLS)
        for (int64_t m = 0; m < n; m++)
            add_delta(sums + cc * n + m * COLS, nw - cc < COLS ? nw - cc : COLS, (int)j->dt,
                      j->y + (j->rows[first + m] * j->y_st + j->cols[p] + c0 + cc) * es);
    ae_commit_end(commit);
}

_Static_assert(sizeof(struct expand_job) <= 256, "pool.h: a job's context is at most 256 bytes");

/* Calls of up to AE_POOL_MAX_ROWS rows (decode steps) run as one job instead, which saves a
 * job's start and end per call (three calls a layer at one stream): an item per (segment,
 * SHRINK_ROWS rows of A) does its shrink and that block's share of each part's expand, into a
 * buffer of partial sums, which the caller then adds block by block, in order (the same sums
 * as the two jobs', in the same order), rounds and adds to y. */
struct fused_job {
    const char *x;   /* as shrink_job's */
    float *partials; /* item (s, b): [count[s]][ntot] at (per_seg * first[s] + b * count[s]) * ntot */
    int64_t K, dt, per_seg, ntot, num_parts;
    int64_t cols[3], widths[3]; /* the parts' columns in a row of partials (and of y) */
    struct segs segs;
};

_Static_assert(sizeof(struct fused_job) <= 256, "pool.h: a job's context is at most 256 bytes");

/* Whether a part (B, lo, r) reads any of A's rows r0 .. r1. */
static ALWAYS_INLINE int part_meets(const int64_t *part, int64_t r0, int64_t r1) {
    return part[0] != 0 && part[1] < r1 && part[1] + part[2] > r0;
}

static void fused_pool_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct fused_job *j = ctx;
    const int64_t s = item / j->per_seg, b = item % j->per_seg, r0 = b * SHRINK_ROWS;
    const int64_t n = j->segs.count[s], first = j->segs.first[s], K = j->K, *d = j->segs.desc[s];
    float *xf = ae_thread_scratch((size_t)((n + 4) * K + n * SHRINK_ROWS + n * j->ntot));
    float *aw = xf + n * K, *sh = aw + 4 * K, *out = sh + n * SHRINK_ROWS;
    const int64_t done = shrink_item(j->x + first * K * elem_size((int)j->dt), n, K, (int)j->dt,
                                     d, r0, xf, sh, SHRINK_ROWS, aw);
    const int wdt = (int)d[AE_LORA_WDT];
    for (int64_t p = 0; p < j->num_parts && done; p++) {
        const int64_t *part = d + AE_LORA_B0 + 3 * p;
        if (!part_meets(part, r0, r0 + done)) continue;
        const int64_t lo = part[1], width = j->widths[p], full = width - width % LANES;
        const int64_t q0 = r0 > lo ? r0 : lo; /* A's rows of both: q0 .. q1 */
        const int64_t q1 = r0 + done < lo + part[2] ? r0 + done : lo + part[2];
        const void *bt = (const void *)part[0];
        /* Row by row of B, front to back (the prefetchers follow), into every row's sums:
         * each column's sum in order of r, as the other paths'. */
        for (int64_t m = 0; m < n; m++) memset(out + m * j->ntot + j->cols[p], 0, (size_t)width * 4);
        for (int64_t r = q0; r < q1; r++) {
            const int64_t at = (r - lo) * width;
            for (int64_t m = 0; m < n; m++) {
                const float u = sh[m * SHRINK_ROWS + r - r0];
                float *o = out + m * j->ntot + j->cols[p];
                for (int64_t c = 0; c < full; c += LANES) {
                    v16f acc = load16(o + c);
                    acc += u * load16_w(bt, at + c, wdt);
                    memcpy(o + c, &acc, sizeof acc);
                }
                for (int64_t c = full; c < width; c++) o[c] += u * load1_w(bt, at + c, wdt);
            }
        }
    }
    if (!ae_commit_begin(commit)) return; /* another thread committed this item */
    float *dst = j->partials + (j->per_seg * first + b * n) * j->ntot;
    for (int64_t p = 0; p < j->num_parts && done; p++) {
        if (!part_meets(d + AE_LORA_B0 + 3 * p, r0, r0 + done)) continue;
        for (int64_t m = 0; m < n; m++)
            memcpy(dst + m * j->ntot + j->cols[p], out + m * j->ntot + j->cols[p],
                   (size_t)j->widths[p] * sizeof(float));
    }
    ae_commit_end(commit);
}

/* The one-job path's sums: each part's partials added block by block, in order, then rounded
 * and added to y (the parts' columns there at y_cols). */
static void add_partials(const struct fused_job *j, int64_t num_segs, const int64_t *y_cols,
                         const int64_t *rows, char *y, int64_t y_st) {
    const int64_t es = elem_size((int)j->dt);
    float delta[COLS];
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t *d = j->segs.desc[s], n = j->segs.count[s], first = j->segs.first[s];
        if (d[AE_LORA_A] == 0) continue;
        for (int64_t p = 0; p < j->num_parts; p++) {
            const int64_t *part = d + AE_LORA_B0 + 3 * p;
            if (part[0] == 0) continue;
            const int64_t b0 = part[1] / SHRINK_ROWS, b1 = (part[1] + part[2] - 1) / SHRINK_ROWS;
            for (int64_t m = 0; m < n; m++) {
                char *yp = y + (rows[first + m] * y_st + y_cols[p]) * es;
                for (int64_t c0 = 0; c0 < j->widths[p]; c0 += COLS) {
                    const int64_t nc = j->widths[p] - c0 < COLS ? j->widths[p] - c0 : COLS;
                    const float *src = j->partials + (j->per_seg * first + m) * j->ntot +
                                       j->cols[p] + c0;
                    for (int64_t c = 0; c < nc; c++) delta[c] = 0.0f;
                    for (int64_t b = b0; b <= b1; b++)
                        for (int64_t c = 0; c < nc; c++) delta[c] += src[b * n * j->ntot + c];
                    add_delta(delta, nc, (int)j->dt, yp + c0 * es);
                }
            }
        }
    }
}

/* ae_lora_add in items, up to POOL_SEGS segments: on the pool where the caller holds it
 * (`pooled`), else in one OpenMP region whose loops are the two jobs (the team of the
 * products around it, whose threads spin between regions where a pool helper would wait for
 * the core). -1 when out of memory. */
static int lora_add_items(int pooled, int dt, const void *x, int64_t x_st, void *y, int64_t y_st,
                          int64_t K, int64_t num_parts, const int64_t *part_cols,
                          const int64_t *part_widths, const int64_t *rows,
                          const int64_t *seg_rows, int64_t num_segs, const int64_t *descs,
                          int64_t desc_offset, int64_t max_rank, int num_threads) {
    struct segs segs = {{0}, {0}, {0}};
    for (int64_t s = 0; s < num_segs; s++) {
        segs.first[s] = seg_rows[s], segs.count[s] = seg_rows[s + 1] - seg_rows[s];
        segs.desc[s] = (const int64_t *)descs[s] + desc_offset;
    }
    const int64_t M = seg_rows[num_segs], es = elem_size(dt);
    /* x's rows, then (off the pool) the shrink's sums, 64-byte aligned */
    const size_t xs_bytes = (size_t)(M * K * es + 63) / 64 * 64;
    const size_t sh_bytes = (size_t)(M * max_rank) * 4;
    char *xs = pooled ? ae_pool_buffer(0, xs_bytes) : malloc(xs_bytes + sh_bytes);
    if (xs == NULL) return -1;
    for (int64_t m = 0; m < M; m++)
        memcpy(xs + m * K * es, (const char *)x + rows[m] * x_st * es, (size_t)(K * es));
    const int64_t per_seg = (max_rank + SHRINK_ROWS - 1) / SHRINK_ROWS;
    if (pooled && M <= AE_POOL_MAX_ROWS) {
        struct fused_job fj = {xs, NULL, K, dt, per_seg, 0, num_parts, {0}, {0}, segs};
        for (int64_t p = 0; p < num_parts; p++) {
            fj.cols[p] = fj.ntot, fj.widths[p] = part_widths[p];
            fj.ntot += part_widths[p];
        }
        fj.partials = ae_pool_buffer(2, (size_t)(per_seg * M * fj.ntot) * sizeof(float));
        if (fj.partials == NULL) return -1;
        const int64_t items = per_seg * num_segs;
        ae_pool_run(fused_pool_item, &fj, sizeof fj, items,
                    items < num_threads ? (int)items : num_threads);
        add_partials(&fj, num_segs, part_cols, rows, (char *)y, y_st);
        return 0;
    }
    float *sh = pooled ? ae_pool_buffer(1, sh_bytes) : (float *)(xs + xs_bytes);
    if (sh == NULL) return -1;
    const struct shrink_job sj = {xs, sh, max_rank, K, dt, per_seg, segs};
    struct expand_job ej = {sh, y, rows, max_rank, y_st, dt, num_parts, 0, {0}, {0}, segs};
    for (int64_t p = 0; p < num_parts; p++) {
        ej.cols[p] = part_cols[p], ej.widths[p] = part_widths[p];
        ej.per_seg += (part_widths[p] + WIDE - 1) / WIDE;
    }
    const int64_t shrink_items = per_seg * num_segs, expand_items = ej.per_seg * num_segs;
    if (pooled) {
        ae_pool_run(shrink_pool_item, &sj, sizeof sj, shrink_items,
                    shrink_items < num_threads ? (int)shrink_items : num_threads);
        ae_pool_run(expand_pool_item, &ej, sizeof ej, expand_items,
                    expand_items < num_threads ? (int)expand_items : num_threads);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < shrink_items; i++) {
            const struct ae_commit alone = {0, i};
            shrink_pool_item(&sj, i, &alone);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < expand_items; i++) {
            const struct ae_commit alone = {0, i};
            expand_pool_item(&ej, i, &alone);
        }
    }
    free(xs);
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
    /* Decode-sized calls on the pool, as linear.c's products (whose caller never waits for a
     * preempted thread); larger ones in one OpenMP region, as the products around them. Those
     * leave their team's threads spinning for the next region, and a pool helper then waits
     * for a core: at 64 rows (4 adapters, SmolLM2's 30 layers, on 2 cores) the pool added
     * ~23 ms to a step, one OpenMP region ~2 ms. (On cores shared with another busy process,
     * OpenMP's barriers wait for preempted threads, LoRA's as the products' own.) */
    if (num_threads > 1 && work >= PARALLEL_MIN_WORK && num_segs <= POOL_SEGS) {
        const int pooled = M <= AE_POOL_MAX_ROWS && ae_pool_acquire();
        const int status = lora_add_items(pooled, dt, x, x_st, y, y_st, K, num_parts, part_cols,
                                          part_widths, rows, seg_rows, num_segs, descs,
                                          desc_offset, max_rank, num_threads);
        if (pooled) ae_pool_release();
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
