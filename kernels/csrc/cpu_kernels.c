/*
 * asyncengine's native CPU kernels: paged attention (decodes and prefill chunks), the paged
 * cache write, RMSNorm, SiLU-and-multiply and a row argmax.
 *
 * Built on first use by kernels/cpu_native.py with the system C compiler
 * (`cc -O3 -march=native -fopenmp`) and called through ctypes, so no torch headers are needed
 * and a build takes about a second. Tensors arrive as data pointers plus element strides.
 *
 * Cache layout of one layer, [2, H_kv, num_blocks, block_size, D] as torch sees it, but
 * with each KEY block stored transposed, [D][block_size]: a block's scores for one query head
 * are then D vector FMAs over block_size keys (one AVX-512 register of fp32 at block_size 16)
 * with no horizontal sums. Value blocks stay [block_size][D], which is already the right way
 * round for the weighted sum. Only these kernels and the "cpu" backend's Python code read a
 * cache written in this layout (kernels/paged_attention_cpu.py).
 *
 * Attention arithmetic is fp32 throughout (loads upcast, one rounding at the store); RMSNorm
 * and SiLU-mul round to the dtype where torch's op chains do.
 */

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "fast_exp.h"

enum { AE_F32 = 0, AE_BF16 = 1, AE_F16 = 2 };

/* The small helpers below sit in every inner loop. GCC stops inlining once a unit has grown
 * past its limits (the attention kernel is inlined three times over, once per dtype), and a
 * call per 16 values then costs more than the work: measured, the attention ran ~2x slower
 * with load16_as_f32 and exp2_normal out of line. So they are always inlined. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE int64_t elem_size(int dt) { return dt == AE_F32 ? 4 : 2; }

/* n elements of dtype `dt` at `src` (contiguous) -> fp32 */
static ALWAYS_INLINE void load_f32(const void *src, float *restrict dst, int64_t n, int dt) {
    if (dt == AE_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == AE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static ALWAYS_INLINE void store_f32(void *dst, const float *restrict src, int64_t n, int dt) {
    if (dt == AE_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == AE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

/* 16 fp32 lanes: one AVX-512 register (two AVX2 ones); GCC lowers it to what the CPU has. */
typedef float v16f __attribute__((vector_size(64)));
#define LANES 16

static ALWAYS_INLINE v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 half-precision values: loaded as they lie in the cache and widened in registers. */
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

/* 16 consecutive values of dtype `dt` at p, as fp32 lanes. */
static ALWAYS_INLINE v16f load16_as_f32(const char *p, int dt) {
    if (dt == AE_F32) return load16((const float *)p);
    if (dt == AE_BF16) {
#ifdef __AVX512F__
        /* one widening load and a shift (GCC's generic lowering takes four shuffles more) */
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
        return (v16f)_mm512_castsi512_ps(u);
#else
        v16u16 h;
        memcpy(&h, p, sizeof h);
        const v16u32 u = __builtin_convertvector(h, v16u32) << 16;
        v16f f;
        memcpy(&f, &u, sizeof f);
        return f;
#endif
    }
    float tmp[LANES];
    const _Float16 *x = (const _Float16 *)p;
    for (int i = 0; i < LANES; i++) tmp[i] = (float)x[i];
    return load16(tmp);
}

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

/*
 * Causal attention for num_seqs sequences of a packed batch, over the paged cache.
 *
 * Sequence i has q_lens[i] query tokens at packed rows q_start[i] .. of query/out, the last
 * q_lens[i] of its seq_lens[i] tokens (all of them already in the cache, the new ones
 * included); its blocks are block_table[i * bt_stride + 0 ..]. query/out: [T, H_q, D] with
 * element strides (token, head), D contiguous; H_q = H_kv * group. Rows of other sequences
 * are left alone. Work is split into (sequence, tile of query tokens, KV head) items, run in
 * parallel.
 */
void ae_paged_attention(int dt, const void *query, int64_t q_st, int64_t q_sh, void *out,
                        int64_t o_st, int64_t o_sh, const void *kv_cache, int64_t num_kv_heads,
                        int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t group,
                        const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens,
                        const int32_t *block_table, int64_t bt_stride, int64_t num_seqs,
                        float scale, int num_threads) {
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
}

/* Ask for the cache lines that store_kv_slot will write for `slot`, every KV head, with intent
 * to write. A step's slots are scattered over the cache, which streams through the caches
 * between one step's write and the next, so each write would otherwise wait on memory. */
static inline void prefetch_kv_slot(const char *k_base, const char *v_base, int64_t head_elems,
                                    int64_t hkv, int64_t slot, int64_t bs, int64_t D, int64_t es) {
    if (slot < 0) return;
    const int64_t blk = slot / bs, off = slot % bs, row = bs * es;
    const int64_t step = row >= 64 ? 1 : 64 / row; /* key rows per cache line */
    for (int64_t h = 0; h < hkv; h++) {
        const int64_t block_start = h * head_elems + blk * bs * D;
        const char *vdst = v_base + (block_start + off * D) * es;
        for (int64_t i = 0; i < D * es; i += 64) __builtin_prefetch(vdst + i, 1, 3);
        const char *kdst = k_base + (block_start + off) * es;
        for (int64_t d = 0; d < D; d += step) __builtin_prefetch(kdst + d * row, 1, 3);
    }
}

/* Store one token's K and V head (D contiguous values each) at `slot` of a layer's cache (key
 * and value halves at k_base / v_base, head_elems elements per head): the value row as it is,
 * the key transposed within its block. A negative slot is skipped (padding). */
static inline void store_kv_slot(char *k_base, char *v_base, int64_t head_elems, int64_t h,
                                 int64_t slot, int64_t bs, int64_t D, int64_t es, const char *k,
                                 const char *v) {
    if (slot < 0) return;
    const int64_t blk = slot / bs, off = slot % bs;
    const int64_t block_start = h * head_elems + blk * bs * D;
    memcpy(v_base + (block_start + off * D) * es, v, (size_t)(D * es));
    char *kdst = k_base + (block_start + off) * es;
    if (es == 4) {
        for (int64_t d = 0; d < D; d++) memcpy(kdst + d * bs * 4, k + d * 4, 4);
    } else {
        for (int64_t d = 0; d < D; d++) memcpy(kdst + d * bs * 2, k + d * 2, 2);
    }
}

/*
 * Write num_tokens new tokens' K and V ([T, H_kv, D] with element strides (token, head); D
 * contiguous; the cache's dtype) into the cache at slot_mapping[t] (block slot / bs, offset
 * slot % bs), keys transposed within their block. A negative slot is skipped (padding).
 */
void ae_reshape_and_cache(int dt, const void *key, int64_t k_st, int64_t k_sh,
                          const void *value, int64_t v_st, int64_t v_sh, void *kv_cache,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                          int64_t head_dim, const int64_t *slot_mapping, int64_t num_tokens,
                          int num_threads) {
    const int64_t es = elem_size(dt);
    const int64_t head_elems = num_blocks * block_size * head_dim;
    char *k_base = (char *)kv_cache;
    char *v_base = k_base + num_kv_heads * head_elems * es;
    const int64_t items = num_tokens * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (items > 256)
    for (int64_t it = 0; it < items; it++) {
        const int64_t t = it / num_kv_heads, h = it % num_kv_heads;
        store_kv_slot(k_base, v_base, head_elems, h, slot_mapping[t], block_size, head_dim, es,
                      (const char *)key + (t * k_st + h * k_sh) * es,
                      (const char *)value + (t * v_st + h * v_sh) * es);
    }
}

/* v rounded to bf16 (to nearest even; a NaN stays a quiet NaN), as 16 bf16 bit patterns:
 * f32_to_bf16, 16 lanes at once. */
static ALWAYS_INLINE v16u32 round16_bf16_bits(v16f v) {
    v16u32 u;
    memcpy(&u, &v, sizeof u);
    const v16u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u32 quiet = (u >> 16) | 0x40u;
    const v16u32 nan = (v16u32)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    return (quiet & nan) | (rounded & ~nan);
}

/* v rounded to bf16 and widened back to fp32: bf16_to_f32(f32_to_bf16(v)), 16 lanes. */
static ALWAYS_INLINE v16f round16_bf16(v16f v) {
    const v16u32 u = round16_bf16_bits(v) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static ALWAYS_INLINE void store16_bf16(uint16_t *p, v16f v) {
    const v16u16 h = __builtin_convertvector(round16_bf16_bits(v), v16u16);
    memcpy(p, &h, sizeof h);
}

/* Round n values to dtype `dt` and back, in place: what torch does between two half-precision
 * ops. (The dtype test sits outside the loops, so that they vectorise.) */
static ALWAYS_INLINE void round_row(float *restrict x, int64_t n, int dt) {
    if (dt == AE_BF16) {
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    } else if (dt == AE_F16) {
        for (int64_t i = 0; i < n; i++) x[i] = (float)(_Float16)x[i];
    }
}

/* RMSNorm of one row of n fp32 values in place, as transformers' LlamaRMSNorm computes it:
 * the mean square in fp32, the normalised row rounded to the dtype, then times the weight
 * (w: the dtype's values widened), rounded again (by the caller's store). The sum of squares
 * is never inlined: every kernel that normalises then runs the same machine code for it, so
 * the same summation order (the compiler may vectorise a reduction differently in each place
 * it is inlined), and the lean forward's fp32 numbers equal those of the model with only its
 * norms swapped. */
static __attribute__((noinline)) float sum_squares(const float *restrict buf, int64_t n) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; i++) sq += buf[i] * buf[i];
    return sq;
}

static __attribute__((noinline)) void rms_norm_row(float *restrict buf, const float *restrict w, int64_t n,
                                float eps, int dt) {
    const float inv = 1.0f / sqrtf(sum_squares(buf, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) buf[i] *= inv;
    round_row(buf, n, dt);
    for (int64_t i = 0; i < n; i++) buf[i] *= w[i];
}

/* The bf16 rows of the two norms below, n a multiple of 16, in registers: rms_norm_row's
 * arithmetic and roundings, with the sum of squares from sum_squares over buf (the row as
 * widened bf16), but two passes over the row instead of about ten over buffers: 2-3x faster. */
static ALWAYS_INLINE void normalize_row_bf16(const float *restrict buf, const float *restrict w,
                                             uint16_t *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(buf, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i += LANES)
        store16_bf16(out + i, round16_bf16(load16(buf + i) * inv) * load16(w + i));
}

/* residual += x (rounded), buf = the sum widened, then out = RMSNorm(buf) */
static ALWAYS_INLINE void add_rms_norm_row_bf16(const uint16_t *x, uint16_t *res, uint16_t *out,
                                                const float *restrict w, float *restrict buf,
                                                int64_t n, float eps) {
    for (int64_t i = 0; i < n; i += LANES) {
        const v16f sum = load16_as_f32((const char *)(res + i), AE_BF16) +
                         load16_as_f32((const char *)(x + i), AE_BF16);
        const v16u32 bits = round16_bf16_bits(sum);
        const v16u16 h = __builtin_convertvector(bits, v16u16);
        memcpy(res + i, &h, sizeof h);
        const v16u32 wide = bits << 16;
        memcpy(buf + i, &wide, sizeof wide);
    }
    normalize_row_bf16(buf, w, out, n, eps);
}

/*
 * RMSNorm of `rows` rows of n values (row strides x_st / o_st in elements), as transformers'
 * LlamaRMSNorm computes it (see rms_norm_row).
 */
void ae_rms_norm(int dt, const void *x, int64_t x_st, void *out, int64_t o_st,
                 const void *weight, int64_t rows, int64_t n, float eps, int num_threads) {
    const int64_t es = elem_size(dt);
#pragma omp parallel num_threads(num_threads) if (rows * n >= 32768)
    {
        float *buf = malloc((size_t)n * sizeof(float));
        float *w = malloc((size_t)n * sizeof(float));
        load_f32(weight, w, n, dt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_f32((const char *)x + r * x_st * es, buf, n, dt);
            if (dt == AE_BF16 && n % LANES == 0) {
                normalize_row_bf16(buf, w, (uint16_t *)out + r * o_st, n, eps);
                continue;
            }
            rms_norm_row(buf, w, n, eps, dt);
            store_f32((char *)out + r * o_st * es, buf, n, dt);
        }
        free(buf);
        free(w);
    }
}

/* Row r of ae_add_rms_norm, in the calling thread: w, the weight widened to fp32; buf and
 * other, n floats of scratch each. (Also the second half of the linear kernel that ends in
 * this norm, cpu_linear.c: the same code, so the same numbers.) */
void ae_add_rms_norm_row(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                         void *out, int64_t o_st, const float *w, float *buf, float *other,
                         int64_t r, int64_t n, float eps) {
    const int64_t es = elem_size(dt);
    char *res = (char *)residual + r * r_st * es;
    if (dt == AE_BF16 && n % LANES == 0) {
        add_rms_norm_row_bf16((const uint16_t *)x + r * x_st, (uint16_t *)res,
                              (uint16_t *)out + r * o_st, w, buf, n, eps);
        return;
    }
    load_f32(res, buf, n, dt);
    load_f32((const char *)x + r * x_st * es, other, n, dt);
    for (int64_t i = 0; i < n; i++) buf[i] += other[i];
    store_f32(res, buf, n, dt);
    round_row(buf, n, dt);
    rms_norm_row(buf, w, n, eps, dt);
    store_f32((char *)out + r * o_st * es, buf, n, dt);
}

/*
 * A pre-norm decoder's residual step, `residual = residual + x; out = RMSNorm(residual)`:
 * the sum rounded to the dtype (as torch's add) and stored back into `residual` in place, then
 * normalised as ae_rms_norm does. Row strides x_st / r_st / o_st in elements.
 */
void ae_add_rms_norm(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                     void *out, int64_t o_st, const void *weight, int64_t rows, int64_t n,
                     float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * n >= 32768)
    {
        float *buf = malloc((size_t)n * sizeof(float));
        float *other = malloc((size_t)n * sizeof(float));
        float *w = malloc((size_t)n * sizeof(float));
        load_f32(weight, w, n, dt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            ae_add_rms_norm_row(dt, x, x_st, residual, r_st, out, o_st, w, buf, other, r, n, eps);
        free(buf);
        free(other);
        free(w);
    }
}

/* Rotary embedding of one head of D values (fp32 in x, in place), rotate-half layout, as
 * transformers computes `x * cos + rotate_half(x) * sin` in the dtype: both products rounded,
 * then their sum (rounded by the caller's store). The products go through memory (a, b) so
 * that the compiler cannot contract them into FMAs, which would change fp32 results. */
static inline void rotate_head(float *restrict x, const float *restrict c,
                               const float *restrict s, float *restrict a, float *restrict b,
                               int64_t D, int dt) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) a[i] = x[i] * c[i];
    for (int64_t i = 0; i < half; i++) b[i] = -x[i + half] * s[i];
    for (int64_t i = half; i < D; i++) b[i] = x[i - half] * s[i];
    round_row(a, D, dt);
    round_row(b, D, dt);
    for (int64_t i = 0; i < D; i++) x[i] = a[i] + b[i];
}

/* rotate_head for one bf16 head in place, D a multiple of 32, all in registers: the same
 * products, roundings and sum (the rounding between them rules out an FMA), 16 lanes at a time
 * from each half. c, s: the token's cos and sin, widened. */
static ALWAYS_INLINE void rotate_head_bf16(uint16_t *x, const float *restrict c,
                                           const float *restrict s, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i += LANES) {
        const v16f x1 = load16_as_f32((const char *)(x + i), AE_BF16);
        const v16f x2 = load16_as_f32((const char *)(x + half + i), AE_BF16);
        const v16f a1 = round16_bf16(x1 * load16(c + i));
        const v16f a2 = round16_bf16(x2 * load16(c + half + i));
        const v16f b1 = round16_bf16(-x2 * load16(s + i));
        const v16f b2 = round16_bf16(x1 * load16(s + half + i));
        store16_bf16(x + i, a1 + b1);
        store16_bf16(x + half + i, a2 + b2);
    }
}

/*
 * Rotary embedding, in place, of T tokens' query heads (hq of them, element strides q_st per
 * token and q_sh per head, D contiguous) and key heads (hkv; k_st, k_sh): rotate-half layout,
 * with cos/sin [T][D] in the dtype (row stride cs_st), rounded as transformers rounds.
 * With q_norm / k_norm given (Qwen3's per-head norms), each head is first RMS-normalised over
 * its D values with that weight (as ae_rms_norm, eps). NULL leaves the heads as they are.
 * With kv_cache given, each token's rotated keys and its values (v, v_st, v_sh) are also
 * written to the cache at slot_mapping[t], as ae_reshape_and_cache writes them (the layer's
 * cache: [2, hkv, num_blocks, block_size, D]).
 */
void ae_rotary(int dt, void *q, int64_t q_st, int64_t q_sh, int64_t hq, void *k, int64_t k_st,
               int64_t k_sh, int64_t hkv, const void *cos, const void *sin, int64_t cs_st,
               int64_t T, int64_t D, const void *q_norm, const void *k_norm, float eps,
               const void *v, int64_t v_st, int64_t v_sh, void *kv_cache, int64_t num_blocks,
               int64_t block_size, const int64_t *slot_mapping, int num_threads) {
    const int64_t es = elem_size(dt);
    const int64_t head_elems = num_blocks * block_size * D;
    char *k_base = (char *)kv_cache;
    char *v_base = kv_cache ? k_base + hkv * head_elems * es : NULL;
#pragma omp parallel num_threads(num_threads) if (T * (hq + hkv) * D >= 32768)
    {
        float *buf = malloc((size_t)(5 * D) * sizeof(float));
        float *c = buf + D, *s = buf + 2 * D, *a = buf + 3 * D, *b = buf + 4 * D;
        float *qw = NULL, *kw = NULL;
        if (q_norm) {
            qw = malloc((size_t)D * sizeof(float));
            load_f32(q_norm, qw, D, dt);
        }
        if (k_norm) {
            kw = malloc((size_t)D * sizeof(float));
            load_f32(k_norm, kw, D, dt);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (kv_cache && t + 2 < T) /* two tokens ahead: ~1 us of work here, more than a miss */
                prefetch_kv_slot(k_base, v_base, head_elems, hkv, slot_mapping[t + 2], block_size,
                                 D, es);
            load_f32((const char *)cos + t * cs_st * es, c, D, dt);
            load_f32((const char *)sin + t * cs_st * es, s, D, dt);
            for (int64_t h = 0; h < hq + hkv; h++) {
                const int is_q = h < hq;
                char *x = is_q ? (char *)q + (t * q_st + h * q_sh) * es
                               : (char *)k + (t * k_st + (h - hq) * k_sh) * es;
                const float *nw = is_q ? qw : kw;
                if (dt == AE_BF16 && !nw && D % (2 * LANES) == 0) {
                    rotate_head_bf16((uint16_t *)x, c, s, D);
                } else {
                    load_f32(x, buf, D, dt);
                    if (nw) {
                        rms_norm_row(buf, nw, D, eps, dt);
                        round_row(buf, D, dt);
                    }
                    rotate_head(buf, c, s, a, b, D, dt);
                    store_f32(x, buf, D, dt);
                }
                if (!is_q && kv_cache)
                    store_kv_slot(k_base, v_base, head_elems, h - hq, slot_mapping[t],
                                  block_size, D, es, x,
                                  (const char *)v + (t * v_st + (h - hq) * v_sh) * es);
            }
        }
        free(buf);
        free(qw);
        free(kw);
    }
}

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

/* argmax of one row of n fp32-widened values at p (dtype dt): see ae_argmax_rows. */
static inline int64_t argmax_row(const char *p, int64_t n, int dt) {
    const int64_t es = elem_size(dt);
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#ifdef __AVX512F__
    /* two passes of 16 lanes: the maximum (and whether a NaN is there), then its first index */
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = (__m512)load16_as_f32(p + i * es, dt);
        vm = _mm512_max_ps(vm, v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    m = _mm512_reduce_max_ps(vm);
    nan = unordered != 0;
#endif
    for (; i < n; i += LANES) { /* the rest (everything, without AVX-512), 16 at a time */
        const int64_t c = n - i < LANES ? n - i : LANES;
        float chunk[LANES];
        load_f32(p + i * es, chunk, c, dt);
        for (int64_t t = 0; t < c; t++) {
            m = chunk[t] > m ? chunk[t] : m;
            nan |= chunk[t] != chunk[t];
        }
    }
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(m);
    for (; j + LANES <= n; j += LANES) {
        const __m512 v = (__m512)load16_as_f32(p + j * es, dt);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
#endif
    for (; j < n; j++) {
        float v;
        load_f32(p + j * es, &v, 1, dt);
        if (nan ? v != v : v == m) return j;
    }
    return 0; /* unreachable for n > 0 */
}

/*
 * out[r] = argmax of row r (n values, row stride x_st elements), as torch.argmax: the first
 * index of the maximum, or of the first NaN when the row has one.
 */
void ae_argmax_rows(int dt, const void *x, int64_t x_st, int64_t rows, int64_t n, int64_t *out,
                    int num_threads) {
    const int64_t es = elem_size(dt);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * x_st * es;
        if (dt == AE_BF16)
            out[r] = argmax_row(row, n, AE_BF16);
        else if (dt == AE_F32)
            out[r] = argmax_row(row, n, AE_F32);
        else
            out[r] = argmax_row(row, n, AE_F16);
    }
}
