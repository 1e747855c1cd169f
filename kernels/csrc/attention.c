/*
 * Paged attention over the KV cache, for decodes and prefill chunks (ae_paged_attention).
 *
 * Cache layout of one layer, [2, H_kv, num_blocks, block_size, D] as torch sees it, but
 * with each KEY block stored transposed, [D][block_size]: a block's scores for one query head
 * are then D vector FMAs over block_size keys (one AVX-512 register of fp32 at block_size 16)
 * with no horizontal sums. Value blocks stay [block_size][D], which is already the right way
 * round for the weighted sum. Only these kernels (and rotary_cache.c, which writes the cache)
 * and the "cpu" backend's Python code read a cache written in this layout
 * (kernels/paged_attention_cpu.py, kernels/reshape_and_cache_cpu.py).
 *
 * Arithmetic is fp32 throughout (loads upcast, one rounding at the store).
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
#include "pool.h"
#include "ae_vec.h"
#include "fast_exp.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/*
 * AVX2 (no AVX-512): the same two passes on pairs of 8-lane registers. GCC lowers the 16-lane
 * vector code below to AVX2 badly (every v16f spilled to the stack and rebuilt lane by lane:
 * decode attention at ~9 GFLOP/s on 2 Zen 3 cores), so these are written with AVX2
 * intrinsics. Each head's 16 lanes are two independent FMA chains; at most 4 heads a call
 * (8 accumulators and the two key or value halves fit in the 16 registers): 8 heads are two
 * calls of 4.
 */
#define AE_ATTN_AVX2 1

/* 16 values of dtype dt at p, as two 8-lane fp32 halves. */
static ALWAYS_INLINE void load16_halves(const char *p, int dt, __m256 *lo, __m256 *hi) {
    if (dt == AE_BF16) {
        *lo = load8_bf16((const uint16_t *)p);
        *hi = load8_bf16((const uint16_t *)p + 8);
    } else if (dt == AE_F32) {
        *lo = _mm256_loadu_ps((const float *)p);
        *hi = _mm256_loadu_ps((const float *)p + 8);
    } else {
        float tmp[LANES];
        const v16f v = load16_as_f32(p, dt);
        memcpy(tmp, &v, sizeof tmp);
        *lo = _mm256_loadu_ps(tmp);
        *hi = _mm256_loadu_ps(tmp + 8);
    }
}

#define DEFINE_SCORES(NG)                                                                      \
    static inline void scores_##NG(const float *restrict q, int64_t D, const char *kblock,     \
                                   int64_t row_bytes, int dt, int64_t n, float *restrict out,  \
                                   int64_t ld_out) {                                           \
        __m256 lo[NG], hi[NG];                                                                  \
        for (int g = 0; g < NG; g++) lo[g] = hi[g] = _mm256_setzero_ps();                       \
        for (int64_t d = 0; d < D; d++) {                                                       \
            __m256 k0, k1;                                                                      \
            load16_halves(kblock + d * row_bytes, dt, &k0, &k1);                                \
            for (int g = 0; g < NG; g++) {                                                      \
                const __m256 qs = _mm256_broadcast_ss(q + g * D + d);                           \
                lo[g] = _mm256_fmadd_ps(qs, k0, lo[g]);                                         \
                hi[g] = _mm256_fmadd_ps(qs, k1, hi[g]);                                         \
            }                                                                                   \
        }                                                                                       \
        (void)n; /* all 16 lanes are stored (see the caller's scores row) */                   \
        for (int g = 0; g < NG; g++) {                                                          \
            _mm256_storeu_ps(out + g * ld_out, lo[g]);                                          \
            _mm256_storeu_ps(out + g * ld_out + 8, hi[g]);                                      \
        }                                                                                       \
    }

#define DEFINE_VALUES(NG)                                                                      \
    static inline void values_##NG(const float *restrict probs, int64_t ld_probs, int64_t D,   \
                                   int64_t d0, int64_t bs, int64_t len, const char *v_head,    \
                                   const int32_t *blocks, int dt, float *restrict acc) {       \
        const int64_t es = elem_size(dt), block_bytes = bs * D * es;                            \
        __m256 lo[NG], hi[NG];                                                                  \
        for (int g = 0; g < NG; g++) lo[g] = hi[g] = _mm256_setzero_ps();                       \
        for (int64_t b = 0; b * bs < len; b++) {                                                \
            const int64_t n = len - b * bs < bs ? len - b * bs : bs;                            \
            const char *vblock = v_head + (int64_t)blocks[b] * block_bytes + d0 * es;           \
            const float *p = probs + b * bs;                                                    \
            for (int64_t j = 0; j < n; j++) {                                                   \
                __m256 v0, v1;                                                                  \
                load16_halves(vblock + j * D * es, dt, &v0, &v1);                               \
                for (int g = 0; g < NG; g++) {                                                  \
                    const __m256 ps = _mm256_broadcast_ss(p + g * ld_probs + j);                \
                    lo[g] = _mm256_fmadd_ps(ps, v0, lo[g]);                                     \
                    hi[g] = _mm256_fmadd_ps(ps, v1, hi[g]);                                     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < NG; g++) {                                                          \
            _mm256_storeu_ps(acc + g * D + d0, lo[g]);                                          \
            _mm256_storeu_ps(acc + g * D + d0 + 8, hi[g]);                                      \
        }                                                                                       \
    }

DEFINE_SCORES(1)
DEFINE_SCORES(2)
DEFINE_SCORES(3)
DEFINE_SCORES(4)
DEFINE_VALUES(1)
DEFINE_VALUES(2)
DEFINE_VALUES(3)
DEFINE_VALUES(4)

static inline void scores_8(const float *restrict q, int64_t D, const char *kblock,
                            int64_t row_bytes, int dt, int64_t n, float *restrict out,
                            int64_t ld_out) {
    scores_4(q, D, kblock, row_bytes, dt, n, out, ld_out);
    scores_4(q + 4 * D, D, kblock, row_bytes, dt, n, out + 4 * ld_out, ld_out);
}

static inline void values_8(const float *restrict probs, int64_t ld_probs, int64_t D, int64_t d0,
                            int64_t bs, int64_t len, const char *v_head, const int32_t *blocks,
                            int dt, float *restrict acc) {
    values_4(probs, ld_probs, D, d0, bs, len, v_head, blocks, dt, acc);
    values_4(probs + 4 * ld_probs, ld_probs, D, d0, bs, len, v_head, blocks, dt, acc + 4 * D);
}
#else
/* Scores of NG query heads against 16 keys of a transposed key block ([D][block_size] in the
 * cache, block_size a multiple of 16; row_bytes apart, kblock at the 16 keys' first column):
 * per dimension, one 16-key row widened once and NG broadcast FMAs. Even and odd dimensions
 * accumulate apart: two independent FMA chains per head hide the FMA latency. */
#define DEFINE_SCORES(NG)                                                                      \
    static inline void scores_##NG(const float *restrict q, int64_t D, const char *kblock,     \
                                   int64_t row_bytes, int dt, int64_t n, float *restrict out,  \
                                   int64_t ld_out) {                                           \
        v16f acc[2][NG];                                                                        \
        for (int g = 0; g < NG; g++) acc[0][g] = acc[1][g] = (v16f){0};                         \
        for (int64_t d = 0; d < D; d += 2) {                                                    \
            const v16f k0 = load16_as_f32(kblock + d * row_bytes, dt);                          \
            const v16f k1 = load16_as_f32(kblock + (d + 1) * row_bytes, dt);                    \
            for (int g = 0; g < NG; g++) {                                                      \
                acc[0][g] += q[g * D + d] * k0;                                                 \
                acc[1][g] += q[g * D + d + 1] * k1;                                             \
            }                                                                                   \
        }                                                                                       \
        (void)n; /* all 16 lanes are stored (see the caller's scores row): no variable copy */ \
        for (int g = 0; g < NG; g++) {                                                          \
            const v16f sum = acc[0][g] + acc[1][g];                                             \
            memcpy(out + g * ld_out, &sum, sizeof sum);                                         \
        }                                                                                       \
    }

/* acc[g][d0:d0+16] = sum over the sequence's keys j of probs[g][j] * v[j][d0:d0+16], for NG
 * heads: the 16 output lanes of each head stay in registers across the whole sequence (even
 * and odd keys apart, again for two FMA chains). */
#define DEFINE_VALUES(NG)                                                                      \
    static inline void values_##NG(const float *restrict probs, int64_t ld_probs, int64_t D,   \
                                   int64_t d0, int64_t bs, int64_t len, const char *v_head,    \
                                   const int32_t *blocks, int dt, float *restrict acc) {       \
        const int64_t es = elem_size(dt), block_bytes = bs * D * es;                            \
        v16f a[2][NG];                                                                          \
        for (int g = 0; g < NG; g++) a[0][g] = a[1][g] = (v16f){0};                             \
        for (int64_t b = 0; b * bs < len; b++) {                                                \
            const int64_t n = len - b * bs < bs ? len - b * bs : bs;                            \
            const char *vblock = v_head + (int64_t)blocks[b] * block_bytes + d0 * es;           \
            const float *p = probs + b * bs;                                                    \
            int64_t j = 0;                                                                      \
            for (; j + 2 <= n; j += 2) {                                                        \
                const v16f v0 = load16_as_f32(vblock + j * D * es, dt);                         \
                const v16f v1 = load16_as_f32(vblock + (j + 1) * D * es, dt);                   \
                for (int g = 0; g < NG; g++) {                                                  \
                    a[0][g] += p[g * ld_probs + j] * v0;                                        \
                    a[1][g] += p[g * ld_probs + j + 1] * v1;                                    \
                }                                                                               \
            }                                                                                   \
            if (j < n) {                                                                        \
                const v16f v0 = load16_as_f32(vblock + j * D * es, dt);                         \
                for (int g = 0; g < NG; g++) a[0][g] += p[g * ld_probs + j] * v0;               \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < NG; g++) {                                                          \
            const v16f sum = a[0][g] + a[1][g];                                                 \
            memcpy(acc + g * D + d0, &sum, sizeof sum);                                         \
        }                                                                                       \
    }

DEFINE_SCORES(1)
DEFINE_SCORES(2)
DEFINE_SCORES(3)
DEFINE_SCORES(4)
DEFINE_SCORES(8)
DEFINE_VALUES(1)
DEFINE_VALUES(2)
DEFINE_VALUES(3)
DEFINE_VALUES(4)
DEFINE_VALUES(8)
#endif

/* The general path's scores: any block size, from an fp32 copy of the transposed key block
 * (kt, [D][ldk], ldk a multiple of 16 with zero padding). */
static void scores_any(const float *restrict q, int64_t R, int64_t D, const float *restrict kt,
                       int64_t ldk, int64_t n, float *restrict out, int64_t ld_out) {
    for (int64_t r = 0; r < R; r++) {
        for (int64_t j0 = 0; j0 < n; j0 += LANES) {
            v16f acc = (v16f){0};
            for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * load16(kt + d * ldk + j0);
            float tmp[LANES];
            memcpy(tmp, &acc, sizeof tmp);
            const int64_t m = n - j0 < LANES ? n - j0 : LANES;
            memcpy(out + r * ld_out + j0, tmp, (size_t)m * sizeof(float));
        }
    }
}

/* Ask for the `bytes` at p to be in cache soon (one request per 64-byte line). */
static ALWAYS_INLINE void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* The same, into the L2 cache (not L1). */
static ALWAYS_INLINE void prefetch_bytes_l2(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

/* The blocks of the item a thread attends next, fetched into L2 while it attends this one. */
struct next_item {
    const char *k_head, *v_head;
    const int32_t *blocks;
    int64_t nblk; /* 0: none */
};

static ALWAYS_INLINE void prefetch_item_block(const struct next_item *next, int64_t b,
                                              int64_t block_bytes) {
    prefetch_bytes_l2(next->k_head + (int64_t)next->blocks[b] * block_bytes, block_bytes);
    prefetch_bytes_l2(next->v_head + (int64_t)next->blocks[b] * block_bytes, block_bytes);
}

#ifdef __AVX512F__
/* exp_nonpositive on 16 lanes (the same steps, so the same values); a NaN stays NaN. */
static ALWAYS_INLINE __m512 exp16_nonpositive(__m512 x) {
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __mmask16 under = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
    /* y second: vmaxps returns its second operand when one is NaN */
    const __m512 yc = _mm512_max_ps(_mm512_set1_ps(-126.0f), y);
    const __m512i ni = _mm512_sub_epi32(
        _mm512_cvttps_epi32(_mm512_add_ps(yc, _mm512_set1_ps(128.5f))), _mm512_set1_epi32(128));
    const __m512 f = _mm512_sub_ps(yc, _mm512_cvtepi32_ps(ni));
    __m512 p = _mm512_set1_ps(1.52527338e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.54035304e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512 scale =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps((__mmask16)~under, p, scale);
}

/* The softmax of a row's first len scores in place, and zeros from len up to len_max, 16 lanes
 * at a time with masks for the ends. The plain loops (attend_tile's fallback) leave a row's
 * last len % 16 values to scalar code whose partial results go through the stack (stalled
 * store forwarding): with short prefill rows that was ~a fifth of the kernel's time. A NaN
 * score poisons the row, as there (the max skips it; its exp does not). */
static ALWAYS_INLINE void softmax_row_avx512(float *restrict sr, int64_t len, int64_t len_max) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= len; j += LANES) vmax = _mm512_max_ps(_mm512_loadu_ps(sr + j), vmax);
    const __mmask16 tail = (__mmask16)((1u << (len - j)) - 1u);
    if (tail) vmax = _mm512_mask_max_ps(vmax, tail, _mm512_maskz_loadu_ps(tail, sr + j), vmax);
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (j = 0; j + LANES <= len; j += LANES) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
        _mm512_storeu_ps(sr + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (tail) {
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + j), m);
        const __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(x));
        _mm512_mask_storeu_ps(sr + j, tail, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (j = 0; j + LANES <= len; j += LANES)
        _mm512_storeu_ps(sr + j, _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv));
    if (tail)
        _mm512_mask_storeu_ps(sr + j, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sr + j), inv));
    /* zeros over len .. len_max: from the tail's end, whole vectors (the row has room: its
     * stride covers whole blocks plus 16) */
    for (j = len; j < len_max; j += LANES) _mm512_storeu_ps(sr + j, _mm512_setzero_ps());
}
#endif

/*
 * One tile of a sequence for one KV head: R = NT * G query rows (NT consecutive query tokens,
 * each with the head's G query heads; row r is token r / G) attend over the first row_len[r / G]
 * cached tokens (causal: a later token sees more), len_max = row_len[NT - 1].
 * q: [R][D] fp32, already scaled. scores: [R][ld_scores] scratch. acc: [R][D] output.
 * A block size and D that are multiples of 16 (the usual case) read the cache directly; anything
 * else goes through fp32 copies of each block (kt: [D][ldk] zero-padded, vb: [bs][D]).
 *
 * The scores pass prefetches the next key block and this block's value block into L1, and the
 * key and value blocks two ahead into L2: blocks are scattered over the cache, so the hardware
 * prefetcher would stall at the start of each. (The L2 requests: 7-15% faster decode
 * attention with a cold cache, SmolLM2's and model c's shapes; deeper L1 requests were slower.)
 * Block b's turn also sends the next item's block b (`next`) to L2, and the rest of a longer
 * next item's blocks follow the last; an item whose blocks came that way (`in_l2`) skips its
 * own two-ahead L2 requests.
 */
static inline __attribute__((always_inline)) void attend_tile(
                       const float *restrict q, int64_t R, int64_t G, int64_t D, int64_t bs,
                       const int64_t *row_len, int64_t len_max,
                       const char *k_head, const char *v_head, const int32_t *blocks, int dt,
                       float *restrict kt, int64_t ldk, float *restrict vb,
                       float *restrict scores, int64_t ld_scores, float *restrict acc,
                       const struct next_item *next, int in_l2) {
    const int64_t es = elem_size(dt);
    const int64_t block_bytes = bs * D * es;
    const int64_t nblk = (len_max + bs - 1) / bs;
    const int fast = bs % LANES == 0 && D % LANES == 0;
    /* 1. scores = q . k for every visible key, one block at a time */
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n = len_max - b * bs < bs ? len_max - b * bs : bs;
        const char *kblock = k_head + (int64_t)blocks[b] * block_bytes;
        if (b + 1 < nblk) prefetch_bytes(k_head + (int64_t)blocks[b + 1] * block_bytes, block_bytes);
        prefetch_bytes(v_head + (int64_t)blocks[b] * block_bytes, n * D * es);
        if (!in_l2 && b + 2 < nblk) { /* and the blocks after, into L2 only: more misses in flight */
            prefetch_bytes_l2(k_head + (int64_t)blocks[b + 2] * block_bytes, block_bytes);
            prefetch_bytes_l2(v_head + (int64_t)blocks[b + 2] * block_bytes, block_bytes);
        }
        if (b < next->nblk) prefetch_item_block(next, b, block_bytes);
        if (!fast) {
            for (int64_t d = 0; d < D; d++) load_f32(kblock + d * bs * es, kt + d * ldk, bs, dt);
            scores_any(q, R, D, kt, ldk, n, scores + b * bs, ld_scores);
            continue;
        }
        for (int64_t j0 = 0; j0 < n; j0 += LANES) { /* 16 keys at a time */
            const char *kcols = kblock + j0 * es;
            const int64_t m = n - j0 < LANES ? n - j0 : LANES, rb = bs * es;
            float *out = scores + b * bs + j0;
            int64_t r = 0;
            for (; r + 8 <= R; r += 8) scores_8(q + r * D, D, kcols, rb, dt, m, out + r * ld_scores, ld_scores);
            if (R - r >= 4) {
                scores_4(q + r * D, D, kcols, rb, dt, m, out + r * ld_scores, ld_scores);
                r += 4;
            }
            if (R - r == 3) scores_3(q + r * D, D, kcols, rb, dt, m, out + r * ld_scores, ld_scores);
            if (R - r == 2) scores_2(q + r * D, D, kcols, rb, dt, m, out + r * ld_scores, ld_scores);
            if (R - r == 1) scores_1(q + r * D, D, kcols, rb, dt, m, out + r * ld_scores, ld_scores);
        }
    }
    /* a next item longer than this one: the rest of its blocks */
    for (int64_t b = nblk; b < next->nblk; b++) prefetch_item_block(next, b, block_bytes);
    /* 2. softmax over each row's visible scores, in place; zero past them (up to len_max), so
     * the values pass can run every row over len_max keys */
    for (int64_t r = 0; r < R; r++) {
        float *sr = scores + r * ld_scores;
        const int64_t len = row_len[r / G];
#ifdef __AVX512F__
        softmax_row_avx512(sr, len, len_max);
#else
        float m = -INFINITY;
        /* a vector max (GCC leaves this reduction scalar without the pragma: ~10% of decode
         * attention on SmolLM2's shapes). A NaN score poisons the row either way. */
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < len; j++) m = sr[j] > m ? sr[j] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            const float e = exp_nonpositive(sr[j] - m);
            sr[j] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; j++) sr[j] *= inv;
        for (int64_t j = len; j < len_max; j++) sr[j] = 0.0f;
#endif
    }
    /* 3. acc = probs . v */
    if (fast) {
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
            int64_t r = 0;
            const float *p = scores;
            for (; r + 8 <= R; r += 8)
                values_8(p + r * ld_scores, ld_scores, D, d0, bs, len_max, v_head, blocks, dt, acc + r * D);
            if (R - r >= 4) {
                values_4(p + r * ld_scores, ld_scores, D, d0, bs, len_max, v_head, blocks, dt, acc + r * D);
                r += 4;
            }
            if (R - r == 3)
                values_3(p + r * ld_scores, ld_scores, D, d0, bs, len_max, v_head, blocks, dt, acc + r * D);
            if (R - r == 2)
                values_2(p + r * ld_scores, ld_scores, D, d0, bs, len_max, v_head, blocks, dt, acc + r * D);
            if (R - r == 1)
                values_1(p + r * ld_scores, ld_scores, D, d0, bs, len_max, v_head, blocks, dt, acc + r * D);
        }
        return;
    }
    for (int64_t i = 0; i < R * D; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n = len_max - b * bs < bs ? len_max - b * bs : bs;
        load_f32(v_head + (int64_t)blocks[b] * block_bytes, vb, n * D, dt);
        for (int64_t r = 0; r < R; r++) {
            const float *p = scores + r * ld_scores + b * bs;
            float *restrict ar = acc + r * D;
            for (int64_t j = 0; j < n; j++) {
                const float pj = p[j];
                const float *restrict vrow = vb + j * D;
                for (int64_t d = 0; d < D; d++) ar[d] += pj * vrow[d];
            }
        }
    }
}

/* Query tokens per tile for G query heads per KV head: about 16 rows, which share each key
 * and value row loaded (a decode is a tile of one token). */
static inline int64_t tile_tokens(int64_t G) {
    const int64_t t = 16 / G;
    return t < 1 ? 1 : (t > 8 ? 8 : t);
}

/* Whether a call's tables describe sequences the kernels can run: each sequence's query tokens
 * at a row >= 0 and no more than its length, and its blocks (as many as its length needs)
 * within its row of the table and ids of the cache's blocks. The engine's plans always are; a
 * call with others is refused before any item starts: the OpenMP loop would read outside the
 * cache, and the pool's items skip what they cannot run (tile_is_sound), so its caller would
 * wait for their commits forever. */
static int tables_sound(const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens,
                        const int32_t *block_table, int64_t bt_stride, int64_t num_seqs,
                        int64_t num_blocks, int64_t block_size) {
    if (num_seqs < 0 || block_size < 1 || bt_stride < 0) return 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q = q_lens[i], n = seq_lens[i];
        if (q_start[i] < 0 || q < 0 || n < q) return 0;
        const int64_t nblk = (n + block_size - 1) / block_size;
        if (nblk > bt_stride) return 0;
        for (int64_t b = 0; b < nblk; b++) {
            const int32_t id = block_table[i * bt_stride + b];
            if (id < 0 || id >= num_blocks) return 0;
        }
    }
    return 1;
}

/*
 * Causal attention for num_seqs sequences of a packed batch, over the paged cache.
 *
 * Sequence i has q_lens[i] query tokens at packed rows q_start[i] .. of query/out, the last
 * q_lens[i] of its seq_lens[i] tokens (all of them already in the cache, the new ones
 * included); its blocks are block_table[i * bt_stride + 0 ..]. query/out: [T, H_q, D] with
 * element strides (token, head), D contiguous; H_q = H_kv * group. Rows of other sequences
 * are left alone. Work is split into (sequence, tile of query tokens, KV head) items, run in
 * parallel. 0 on success; -2, with nothing written, where the tables are not sound (see
 * tables_sound).
 */
int ae_paged_attention(int dt, const void *query, int64_t q_st, int64_t q_sh, void *out,
                       int64_t o_st, int64_t o_sh, const void *kv_cache, int64_t num_kv_heads,
                       int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t group,
                       const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens,
                       const int32_t *block_table, int64_t bt_stride, int64_t num_seqs,
                       float scale, int num_threads) {
    if (!tables_sound(q_start, q_lens, seq_lens, block_table, bt_stride, num_seqs, num_blocks,
                      block_size))
        return -2;
    const int64_t es = elem_size(dt);
    const int64_t D = head_dim, G = group, bs = block_size;
    const int64_t TQ = tile_tokens(G);
    const int64_t head_bytes = num_blocks * bs * D * es;
    const char *k_base = (const char *)kv_cache;
    const char *v_base = k_base + num_kv_heads * head_bytes;
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t ldk = (bs + LANES - 1) / LANES * LANES;
    /* whole blocks, plus 16 columns, so 16-wide score stores past a short block stay inside */
    const int64_t ld_scores = (max_len + bs - 1) / bs * bs + LANES;
    /* first_tile[i]: how many tiles the sequences before i have */
    int64_t *first_tile = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    first_tile[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) first_tile[i + 1] = first_tile[i] + (q_lens[i] + TQ - 1) / TQ;
    const int64_t items = first_tile[num_seqs] * num_kv_heads;
    const int64_t R_max = TQ * G;

#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        float *q = malloc((size_t)(R_max * D) * sizeof(float));
        float *acc = malloc((size_t)(R_max * D) * sizeof(float));
        /* zeroed: the padding columns of a transposed key block stay 0 */
        float *kt = calloc((size_t)(ldk * D), sizeof(float));
        float *vb = malloc((size_t)(bs * D) * sizeof(float));
        float *scores = malloc((size_t)(R_max * ld_scores) * sizeof(float));
        int64_t s = 0; /* the sequence of the last item, where the next search starts */
        const int nthr = omp_get_num_threads();
        /* Items go round-robin (static, 1) rather than first come first served, so a thread
         * knows its next item and can have that item's blocks fetched while it works on this
         * one: each item otherwise starts with a stall on its first, scattered, blocks
         * (decode attention with a cold cache, model c's and SmolLM2's heads: 10-31% faster) */
#pragma omp for schedule(static, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t tile = it / num_kv_heads, h = it % num_kv_heads;
            if (tile < first_tile[s]) s = 0;
            while (first_tile[s + 1] <= tile) s++;
            const int in_l2 = it >= nthr; /* the previous item fetched this one's blocks */
            struct next_item next = {0};
            if (it + nthr < items) { /* this thread's next item (the schedule is static) */
                const int64_t next_tile = (it + nthr) / num_kv_heads, nh = (it + nthr) % num_kv_heads;
                int64_t ns = s;
                while (first_tile[ns + 1] <= next_tile) ns++;
                next.k_head = k_base + nh * head_bytes;
                next.v_head = v_base + nh * head_bytes;
                next.blocks = block_table + ns * bt_stride;
                /* the blocks that tile sees: up to its last query token (causal) */
                const int64_t next_t0 = (next_tile - first_tile[ns]) * TQ;
                const int64_t next_nt = q_lens[ns] - next_t0 < TQ ? q_lens[ns] - next_t0 : TQ;
                const int64_t next_len = seq_lens[ns] - q_lens[ns] + next_t0 + next_nt;
                next.nblk = (next_len + bs - 1) / bs;
            }
            const int64_t t0 = (tile - first_tile[s]) * TQ; /* the tile's first query token */
            const int64_t nt = q_lens[s] - t0 < TQ ? q_lens[s] - t0 : TQ;
            const int64_t R = nt * G;
            int64_t row_len[8];
            for (int64_t t = 0; t < nt; t++) row_len[t] = seq_lens[s] - q_lens[s] + t0 + t + 1;
            for (int64_t t = 0; t < nt; t++) {
                const int64_t row = q_start[s] + t0 + t;
                for (int64_t g = 0; g < G; g++) {
                    const char *src = (const char *)query + (row * q_st + (h * G + g) * q_sh) * es;
                    float *qr = q + (t * G + g) * D;
                    load_f32(src, qr, D, dt);
                    for (int64_t d = 0; d < D; d++) qr[d] *= scale;
                }
            }
            const char *k_head = k_base + h * head_bytes, *v_head = v_base + h * head_bytes;
            const int32_t *blocks = block_table + s * bt_stride;
            const int64_t len_max = row_len[nt - 1];
            /* a constant dtype per call site, so its tests leave the inner loops */
            if (dt == AE_BF16)
                attend_tile(q, R, G, D, bs, row_len, len_max, k_head, v_head, blocks, AE_BF16, kt,
                            ldk, vb, scores, ld_scores, acc, &next, in_l2);
            else if (dt == AE_F32)
                attend_tile(q, R, G, D, bs, row_len, len_max, k_head, v_head, blocks, AE_F32, kt,
                            ldk, vb, scores, ld_scores, acc, &next, in_l2);
            else
                attend_tile(q, R, G, D, bs, row_len, len_max, k_head, v_head, blocks, AE_F16, kt,
                            ldk, vb, scores, ld_scores, acc, &next, in_l2);
            for (int64_t t = 0; t < nt; t++) {
                const int64_t row = q_start[s] + t0 + t;
                for (int64_t g = 0; g < G; g++) {
                    char *dst = (char *)out + (row * o_st + (h * G + g) * o_sh) * es;
                    store_f32(dst, acc + (t * G + g) * D, D, dt);
                }
            }
        }
        free(q);
        free(acc);
        free(kt);
        free(vb);
        free(scores);
    }
    free(first_tile);
    return 0;
}

/* ---- The same items on linear.c's work pool (pool.c), for decode_layers.c's short steps ----
 *
 * attention_item is ae_paged_attention's loop body (the same attend_tile on the same rows, so
 * the same numbers), run by whichever pool thread claims it and stored only on its commit.
 * ae_paged_attention keeps its own loop: this one's checks and copies measured a few percent
 * slower on prefill chunks and large batches, where the pool does not run anyway. */

/* One call's work, shared by its (sequence, tile of query tokens, KV head) items. */
struct attn_call {
    const void *query;
    void *out;
    const char *k_base, *v_base;
    const int64_t *first_tile; /* [num_seqs + 1]: how many tiles the sequences before i have */
    const int64_t *q_start;
    const int32_t *q_lens, *seq_lens, *block_table;
    int64_t q_st, q_sh, o_st, o_sh, head_bytes, num_kv_heads, D, G, bs, TQ, ldk, ld_scores;
    int64_t items, bt_stride, num_seqs, num_blocks;
    int64_t rows; /* of query (the pool's copy) */
    float scale;
};

/* A thread's buffers for the items it runs. */
struct attn_scratch {
    float *q, *acc, *kt, *vb, *scores;
    int32_t *blocks; /* the item's own copy of its block ids: ld_scores / bs of them at most */
};

static struct attn_call plan_call(const void *query, int64_t q_st, int64_t q_sh,
                                  void *out, int64_t o_st, int64_t o_sh, const void *kv_cache,
                                  int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                  int64_t head_dim, int64_t group, const int64_t *q_start,
                                  const int32_t *q_lens, const int32_t *seq_lens,
                                  const int32_t *block_table, int64_t bt_stride,
                                  int64_t num_seqs, float scale, int64_t *first_tile,
                                  int64_t rows) {
    struct attn_call c;
    c.query = query, c.q_st = q_st, c.q_sh = q_sh, c.out = out, c.o_st = o_st;
    c.o_sh = o_sh, c.num_kv_heads = num_kv_heads, c.D = head_dim, c.G = group;
    c.bs = block_size, c.TQ = tile_tokens(group), c.q_start = q_start, c.q_lens = q_lens;
    c.seq_lens = seq_lens, c.block_table = block_table, c.bt_stride = bt_stride;
    c.scale = scale, c.first_tile = first_tile, c.num_seqs = num_seqs;
    c.num_blocks = num_blocks, c.rows = rows;
    c.head_bytes = num_blocks * block_size * head_dim * 2; /* bf16 */
    c.k_base = (const char *)kv_cache;
    c.v_base = c.k_base + num_kv_heads * c.head_bytes;
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    c.ldk = (block_size + LANES - 1) / LANES * LANES;
    /* whole blocks, plus 16 columns, so 16-wide score stores past a short block stay inside */
    c.ld_scores = (max_len + block_size - 1) / block_size * block_size + LANES;
    first_tile[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++)
        first_tile[i + 1] = first_tile[i] + (q_lens[i] + c.TQ - 1) / c.TQ;
    c.items = first_tile[num_seqs] * num_kv_heads;
    return c;
}

/* The sequence of tile `tile`, searching from s (a hint, or 0); -1 where the tables
 * disagree (see attention_item). */
static int64_t seq_of(const struct attn_call *c, int64_t tile, int64_t s) {
    if (s < 0 || s >= c->num_seqs || tile < c->first_tile[s]) s = 0;
    while (s < c->num_seqs && c->first_tile[s + 1] <= tile) s++;
    return s < c->num_seqs && tile >= c->first_tile[s] ? s : -1;
}

/* Whether a tile of query tokens t0 .. t0 + nt of a sequence at query row `start`, `len` tokens
 * visible to its last, over the `nblk` blocks `blocks`, can be run: rows of the query, lengths
 * within the scores' width, blocks of the cache. A call's tables are consistent, so this only
 * fails for a pool helper that was preempted inside an item until after its call returned,
 * reading tables that the next call is rewriting (its results are then dropped, see pool.h):
 * it must not turn them into addresses outside the buffers. Which is why an item reads each
 * value of the tables once, into its own variables and memory, and checks those. */
static int tile_is_sound(const struct attn_call *c, int64_t start, int64_t t0, int64_t nt,
                         int64_t len, const int32_t *blocks, int64_t nblk) {
    if (nt < 1 || nt > c->TQ || t0 < 0 || start < 0 || start + t0 + nt > c->rows ||
        len - nt < 0 || len > c->ld_scores - LANES || nblk > c->bt_stride)
        return 0;
    for (int64_t b = 0; b < nblk; b++)
        if (blocks[b] < 0 || blocks[b] >= c->num_blocks) return 0;
    return 1;
}

/*
 * Item `it`: its tile's query rows against its KV head's keys and values, into `out` if
 * `commit` allows (see pool.h). `nx`: the item this thread runs next (-1: none), whose blocks are fetched meanwhile; `in_l2`:
 * this item's blocks were fetched so by the one before.
 */
static void attention_item(const struct attn_call *c, int64_t it, const struct attn_scratch *sc,
                           int64_t nx, int in_l2, const struct ae_commit *commit) {
    const int64_t D = c->D, G = c->G, TQ = c->TQ, es = 2; /* bf16 */
    const int64_t tile = it / c->num_kv_heads, h = it % c->num_kv_heads;
    const int64_t sq = seq_of(c, tile, 0);
    if (sq < 0) return; /* tables being rewritten: see tile_is_sound */
    /* each value of the tables read once (see tile_is_sound) */
    const int64_t start = c->q_start[sq], q_len = c->q_lens[sq], seq_len = c->seq_lens[sq];
    const int64_t t0 = (tile - c->first_tile[sq]) * TQ; /* the tile's first query token */
    const int64_t nt = q_len - t0 < TQ ? q_len - t0 : TQ;
    const int64_t len_max = seq_len - q_len + t0 + nt; /* what the tile's last token sees */
    const int64_t nblk = len_max < 1 ? 0 : (len_max + c->bs - 1) / c->bs;
    int32_t *blocks = sc->blocks;
    if (nblk <= c->bt_stride)
        memcpy(blocks, c->block_table + sq * c->bt_stride, (size_t)nblk * sizeof(int32_t));
    if (!tile_is_sound(c, start, t0, nt, len_max, blocks, nblk)) return;
    struct next_item next = {0};
    const int64_t ns = nx >= 0 && nx < c->items ? seq_of(c, nx / c->num_kv_heads, sq) : -1;
    if (ns >= 0) {
        const int64_t next_tile = nx / c->num_kv_heads, nh = nx % c->num_kv_heads;
        next.k_head = c->k_base + nh * c->head_bytes;
        next.v_head = c->v_base + nh * c->head_bytes;
        next.blocks = c->block_table + ns * c->bt_stride;
        /* the blocks that tile sees: up to its last query token (causal) */
        const int64_t next_t0 = (next_tile - c->first_tile[ns]) * TQ;
        const int64_t next_nt = c->q_lens[ns] - next_t0 < TQ ? c->q_lens[ns] - next_t0 : TQ;
        const int64_t next_len = c->seq_lens[ns] - c->q_lens[ns] + next_t0 + next_nt;
        next.nblk = (next_len + c->bs - 1) / c->bs;
        if (next.nblk < 0 || next.nblk > c->bt_stride) next.nblk = 0; /* see tile_is_sound */
    }
    const int64_t R = nt * G;
    int64_t row_len[8];
    for (int64_t t = 0; t < nt; t++) row_len[t] = seq_len - q_len + t0 + t + 1;
    for (int64_t t = 0; t < nt; t++) {
        const int64_t row = start + t0 + t;
        for (int64_t g = 0; g < G; g++) {
            const char *src =
                (const char *)c->query + (row * c->q_st + (h * G + g) * c->q_sh) * es;
            float *qr = sc->q + (t * G + g) * D;
            load_f32(src, qr, D, AE_BF16);
            for (int64_t d = 0; d < D; d++) qr[d] *= c->scale;
        }
    }
    const char *k_head = c->k_base + h * c->head_bytes, *v_head = c->v_base + h * c->head_bytes;
    attend_tile(sc->q, R, G, D, c->bs, row_len, len_max, k_head, v_head, blocks, AE_BF16, sc->kt,
                c->ldk, sc->vb, sc->scores, c->ld_scores, sc->acc, &next, in_l2);
    if (!ae_commit_begin(commit)) return; /* another thread stored this item */
    for (int64_t t = 0; t < nt; t++) {
        const int64_t row = start + t0 + t;
        for (int64_t g = 0; g < G; g++) {
            char *dst = (char *)c->out + (row * c->o_st + (h * G + g) * c->o_sh) * es;
            store_f32(dst, sc->acc + (t * G + g) * D, D, AE_BF16);
        }
    }
    ae_commit_end(commit);
}

/* This thread's buffers for items of call c, grown as needed (kept for the thread's life). */
static struct attn_scratch thread_attn_scratch(const struct attn_call *c) {
    static __thread float *buf;
    static __thread size_t size;
    const int64_t R_max = c->TQ * c->G, D = c->D;
    const size_t q = (size_t)(R_max * D), kt = (size_t)(c->ldk * D), vb = (size_t)(c->bs * D);
    const size_t floats = 2 * q + kt + vb + (size_t)(R_max * c->ld_scores) +
                          (size_t)(c->ld_scores / c->bs + 1); /* the block ids (int32) */
    if (floats > size) {
        float *grown = realloc(buf, floats * sizeof(float));
        if (grown == NULL) abort(); /* scratch for one item: no way on without it */
        buf = grown;
        size = floats;
    }
    float *scores = buf + 2 * q + kt + vb;
    struct attn_scratch sc = {buf, buf + q, buf + 2 * q, buf + 2 * q + kt, scores,
                              (int32_t *)(scores + R_max * c->ld_scores)};
    memset(sc.kt, 0, kt * sizeof(float)); /* the padding columns of a key block must be 0 */
    return sc;
}

static void attention_pool_item(const void *ctx, int64_t it, const struct ae_commit *commit) {
    const struct attn_call *c = ctx;
    const struct attn_scratch sc = thread_attn_scratch(c);
    /* the item this thread ran before: if it was it - 1 of this job, it fetched our blocks */
    static __thread uint64_t last_job;
    static __thread int64_t last_item = -2;
    const int in_l2 = commit->job != 0 && commit->job == last_job && last_item == it - 1;
    last_job = commit->job, last_item = it;
    attention_item(c, it, &sc, it + 1, in_l2, commit); /* a thread's share is in order */
}

/*
 * ae_paged_attention (bf16) on the pool (pool.c), for decode_layers.c: the same items and
 * numbers, claimed by whichever thread is running. The query rows (hq * D values each, row
 * stride q_st) and the sequences' lengths and blocks are copied into the pool's buffers first,
 * as a helper preempted inside an item may read on after the call returned; the cache stays
 * where it is (the model's). 0 on success, -1 when out of memory, -2 where the tables are not
 * sound (see tables_sound).
 */
int ae_paged_attention_pool(const void *query, int64_t q_st, int64_t hq, void *out,
                            int64_t o_st, const void *kv_cache, int64_t num_kv_heads,
                            int64_t num_blocks, int64_t block_size, int64_t head_dim,
                            const int64_t *q_start, const int32_t *q_lens,
                            const int32_t *seq_lens, const int32_t *block_table,
                            int64_t bt_stride, int64_t num_seqs, float scale, int num_threads) {
    if (!tables_sound(q_start, q_lens, seq_lens, block_table, bt_stride, num_seqs, num_blocks,
                      block_size))
        return -2;
    if (!ae_pool_acquire()) /* another thread holds the pool: run on OpenMP */
        return ae_paged_attention(AE_BF16, query, q_st, head_dim, out, o_st, head_dim, kv_cache,
                                  num_kv_heads, num_blocks, block_size, head_dim,
                                  hq / num_kv_heads, q_start, q_lens, seq_lens, block_table,
                                  bt_stride, num_seqs, scale, num_threads);
    int64_t T = 0;
    for (int64_t i = 0; i < num_seqs; i++)
        if (q_start[i] + q_lens[i] > T) T = q_start[i] + q_lens[i];
    const int64_t row = hq * head_dim;
    uint16_t *q_copy = ae_pool_buffer(1, (size_t)(T * row) * 2);
    const size_t meta = (size_t)(2 * num_seqs + 1) * sizeof(int64_t) +
                        (size_t)(2 * num_seqs + num_seqs * bt_stride) * sizeof(int32_t);
    char *m = ae_pool_buffer(2, meta);
    if (q_copy == NULL || m == NULL) {
        ae_pool_release();
        return -1;
    }
    for (int64_t t = 0; t < T; t++)
        memcpy(q_copy + t * row, (const uint16_t *)query + t * q_st, (size_t)row * 2);
    int64_t *first_tile = (int64_t *)m, *starts = first_tile + num_seqs + 1;
    int32_t *lens = (int32_t *)(starts + num_seqs), *qlens = lens + num_seqs;
    int32_t *table = qlens + num_seqs;
    memcpy(starts, q_start, (size_t)num_seqs * sizeof(int64_t));
    memcpy(lens, seq_lens, (size_t)num_seqs * sizeof(int32_t));
    memcpy(qlens, q_lens, (size_t)num_seqs * sizeof(int32_t));
    memcpy(table, block_table, (size_t)(num_seqs * bt_stride) * sizeof(int32_t));
    const struct attn_call c =
        plan_call(q_copy, row, head_dim, out, o_st, head_dim, kv_cache, num_kv_heads,
                  num_blocks, block_size, head_dim, hq / num_kv_heads, starts, qlens, lens,
                  table, bt_stride, num_seqs, scale, first_tile, T);
    const int team = c.items < num_threads ? (int)c.items : num_threads;
    ae_pool_run(attention_pool_item, &c, sizeof c, c.items, team);
    ae_pool_release();
    return 0;
}
