/*
 * Writes into the paged KV cache (ae_reshape_and_cache) and rotary embedding of queries and
 * keys, optionally fused with that cache write (ae_rotary). The cache's layout, key blocks
 * transposed, is described in attention.c. Rotary rounds to the dtype where transformers' op
 * chain rounds.
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
