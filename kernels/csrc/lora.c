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
 * Work: the segment's rows of x widened once; the shrink in items of (segment, 8 rows of A),
 * each row of A read once for all of the segment's rows; the expand in items of (segment, part,
 * 64 columns), each B block read once for all of them. So each adapter's weights are read once
 * per call, however many rows use it. The inner loops are 16-lane fp32 vectors (ae_vec.h's
 * v16f: one AVX-512 register, two AVX2 ones, or scalar code on other builds) with FMAs where
 * the build has them.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ae_kernels.h"
#include "ae_vec.h"

#define SHRINK_ROWS 8 /* rows of A per shrink item */
#define COLS 64       /* columns of B per expand item: four 16-lane accumulators */
/* Below this many multiply-adds a call runs in the calling thread: a team's start and
 * barriers cost more than the work (a one-row rank-16 q/k/v shrink is ~40k). */
#define PARALLEL_MIN_WORK 131072

/* 16 weights of dtype wdt (AE_F32 or AE_BF16) at element i of w, as fp32 lanes. */
static ALWAYS_INLINE v16f load16_w(const void *w, int64_t i, int wdt) {
    return load16_as_f32((const char *)w + i * elem_size(wdt), wdt);
}

static ALWAYS_INLINE float load1_w(const void *w, int64_t i, int wdt) {
    return wdt == AE_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

static ALWAYS_INLINE float hsum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* sh[m * ld + r] = xf[m] . A[r] for the segment's n rows (xf dense [n][K]) and rows r0 .. r1
 * of A; four rows of A at a time share each load of x. */
static void shrink(const float *xf, int64_t n, int64_t K, const void *a, int wdt, int64_t r0,
                   int64_t r1, float *sh, int64_t ld) {
    const int64_t kv = K - K % LANES;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        for (int64_t m = 0; m < n; m++) {
            const float *x = xf + m * K;
            v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < kv; k += LANES) {
                const v16f xv = load16(x + k);
                a0 += xv * load16_w(a, r * K + k, wdt);
                a1 += xv * load16_w(a, (r + 1) * K + k, wdt);
                a2 += xv * load16_w(a, (r + 2) * K + k, wdt);
                a3 += xv * load16_w(a, (r + 3) * K + k, wdt);
            }
            float s[4] = {hsum16(a0), hsum16(a1), hsum16(a2), hsum16(a3)};
            for (int64_t i = 0; i < 4; i++) {
                for (int64_t k = kv; k < K; k++) s[i] += x[k] * load1_w(a, (r + i) * K + k, wdt);
                sh[m * ld + r + i] = s[i];
            }
        }
    }
    for (; r < r1; r++) {
        for (int64_t m = 0; m < n; m++) {
            const float *x = xf + m * K;
            v16f acc = {0};
            for (int64_t k = 0; k < kv; k += LANES) acc += load16(x + k) * load16_w(a, r * K + k, wdt);
            float s = hsum16(acc);
            for (int64_t k = kv; k < K; k++) s += x[k] * load1_w(a, r * K + k, wdt);
            sh[m * ld + r] = s;
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

/* y rows[m], columns c0 .. c0 + nc (nc <= COLS) of part p, += round(sh[m][lo:lo + rank] @
 * B[:, c0:c0 + nc]) for the segment's n rows; B [rank][N] of dtype wdt. Whole blocks of COLS
 * columns run two rows at a time in eight accumulators, each load of B serving both. */
static void expand(const float *sh, int64_t ld, const int64_t *rows, int64_t n, const void *b,
                   int wdt, int64_t lo, int64_t rank, int64_t N, int64_t c0, int64_t nc,
                   int dt, char *y, int64_t y_st, int64_t col) {
    const int64_t es = elem_size(dt);
    float delta[2][COLS];
    int64_t m = 0;
    if (nc == COLS) {
        for (; m + 2 <= n; m += 2) {
            const float *s0 = sh + m * ld + lo, *s1 = s0 + ld;
            v16f p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
            for (int64_t r = 0; r < rank; r++) {
                const int64_t at = r * N + c0;
                const v16f b0 = load16_w(b, at, wdt), b1 = load16_w(b, at + 16, wdt);
                const v16f b2 = load16_w(b, at + 32, wdt), b3 = load16_w(b, at + 48, wdt);
                const float u = s0[r], v = s1[r];
                p0 += u * b0, p1 += u * b1, p2 += u * b2, p3 += u * b3;
                q0 += v * b0, q1 += v * b1, q2 += v * b2, q3 += v * b3;
            }
            memcpy(delta[0], &p0, 64), memcpy(delta[0] + 16, &p1, 64);
            memcpy(delta[0] + 32, &p2, 64), memcpy(delta[0] + 48, &p3, 64);
            memcpy(delta[1], &q0, 64), memcpy(delta[1] + 16, &q1, 64);
            memcpy(delta[1] + 32, &q2, 64), memcpy(delta[1] + 48, &q3, 64);
            add_delta(delta[0], COLS, dt, y + (rows[m] * y_st + col + c0) * es);
            add_delta(delta[1], COLS, dt, y + (rows[m + 1] * y_st + col + c0) * es);
        }
    }
    const int64_t full = nc - nc % LANES;
    for (; m < n; m++) { /* a last odd row, or a block narrower than COLS */
        const float *s = sh + m * ld + lo;
        for (int64_t c = 0; c < full; c += LANES) {
            v16f acc = {0};
            for (int64_t r = 0; r < rank; r++) acc += s[r] * load16_w(b, r * N + c0 + c, wdt);
            memcpy(delta[0] + c, &acc, sizeof acc);
        }
        for (int64_t c = full; c < nc; c++) {
            float t = 0.0f;
            for (int64_t r = 0; r < rank; r++) t += s[r] * load1_w(b, r * N + c0 + c, wdt);
            delta[0][c] = t;
        }
        add_delta(delta[0], nc, dt, y + (rows[m] * y_st + col + c0) * es);
    }
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
                   (int)d[AE_LORA_WDT], r0, r1, sh + first * max_rank, max_rank);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < expand_items; it++) {
            const int64_t s = expand_at[3 * it], p = expand_at[3 * it + 1];
            const int64_t c0 = expand_at[3 * it + 2];
            const int64_t *d = (const int64_t *)descs[s] + desc_offset;
            const int64_t *part = d + AE_LORA_B0 + 3 * p, first = seg_rows[s];
            const int64_t width = part_widths[p];
            expand(sh + first * max_rank, max_rank, rows + first, seg_rows[s + 1] - first,
                   (const void *)part[0], (int)d[AE_LORA_WDT], part[1], part[2], width, c0,
                   width - c0 < COLS ? width - c0 : COLS, dt, (char *)y, y_st, part_cols[p]);
        }
    }
    free(items);
    free(xf);
    return 0;
}
