/*
 * The lean CPU forward's decoder layers in one call (ae_decode_layers_bf16), for bf16 models
 * whose linear layers run on the native kernels (linear_dense.c's panels on AVX2 CPUs,
 * linear.c's blocks on AVX512-BF16 ones, GGUF's quantized blocks on quant_legacy.c's and
 * quant_kquants.c's kernels, in any mix) and whose step has no long prefill chunk.
 *
 * Why: a SmolLM2 decode step is 30 layers of six to nine kernel calls. From Python each call
 * costs 15-40 us of interpreter, ctypes and tensor allocation on top of its work (measured on
 * 2 Zen 3 cores: a 576-wide RMSNorm takes 15 us through rms_norm_cpu against about 1 us of
 * arithmetic), about 8 ms of a 25 ms step. Here the same kernels run in the same order on the
 * same buffers, so the numbers are the Python loop's to the bit
 * (tests/model/test_decode_layers.py), without the interpreter between them. Back-to-back
 * parallel regions also keep OpenMP's threads inside their spin (GOMP_SPINCOUNT) instead of
 * letting them fall asleep between two calls.
 *
 * Per layer: x = norm(residual) (the first layer) or residual += mlp_out, x = norm(residual);
 * qkv = x @ [Wq; Wk; Wv] (one joint weight or three products into one buffer); rotary on q and
 * k (after Qwen3's per-head norms) with the cache write of k and v; paged attention; residual +=
 * attn @ Wo, x = norm(residual); act = silu(x @ Wg) * (x @ Wu); mlp_out = act @ Wd. The last
 * layer's mlp_out is left to the caller, which adds it and takes the final norm on the rows it
 * samples. Over linear.c's weights, a product and what follows it run as one of its fused
 * calls where the Python loop uses them (ae_linear_add_rms_norm_bf16, ae_linear_silu_bf16):
 * the same numbers as the two steps, in one thread team.
 *
 * LoRA: a step whose rows use adapters passes their segments (struct lora_step); after each
 * group of products (q/k/v, o, gate/up, down) lora.c's ae_lora_add adds each segment's
 * low-rank product to its rows, before the rotary, the residual add and norm or the
 * activation (which then run as their own kernels, not fused into the product), as the
 * Python loop adds them (model/lora_layers.py). ae_lora_add runs decode-sized calls on the pool
 * itself, as linear.c's products do.
 */

#include <stdint.h>

#include "ae_kernels.h"
#include "pool.h"

/* A weight as the table gives it: its address, its bias (0: none) and which kernel reads it:
 * kp > 0, linear.c's blocks with that padded input extent; 0, linear_dense.c's panels; kp < 0,
 * GGUF blocks of quantized format -kp - 1 (ae_linear_quant's format codes). */
struct weight {
    const void *w, *b;
    int64_t kp;
};

static struct weight weight_at(const int64_t *p, int w, int b, int kp) {
    return (struct weight){(const void *)p[w], (const void *)p[b], p[kp]};
}

/* out = x @ W^T + b, T rows of K into N columns (row strides ldx, ldo); nonzero where the
 * kernel had no memory. */
static int product(const void *x, int64_t ldx, int64_t T, struct weight wt, int64_t N,
                   int64_t K, void *out, int64_t ldo, int threads) {
    if (wt.kp > 0) {
        ae_linear_bf16(x, ldx, T, wt.w, N, K, wt.kp, wt.b, out, ldo, threads);
        return 0;
    }
    if (wt.kp < 0)
        return ae_linear_quant((int)(-wt.kp - 1), AE_BF16, x, ldx, T, wt.w, N, K, wt.b, out, ldo,
                               threads);
    return ae_linear_bf16_dense(x, ldx, T, wt.w, N, K, wt.b, out, ldo, threads);
}

/* residual += x @ W^T + b; out = RMSNorm(residual) * norm (N columns, all buffers of row
 * stride N): in one call where linear.c has it fused (as PackedLinear.add_rms_norm: N a
 * multiple of 16), else the product into `buf` then ae_add_rms_norm. */
static int product_add_norm(const void *x, int64_t ldx, int64_t T, struct weight wt, int64_t N,
                            int64_t K, void *buf, void *residual, const void *norm, float eps,
                            void *out, int threads) {
    if (wt.kp > 0 && N % 16 == 0) {
        ae_linear_add_rms_norm_bf16(x, ldx, T, wt.w, N, K, wt.kp, wt.b, buf, residual, N, norm,
                                    eps, out, N, threads);
        return 0;
    }
    if (product(x, ldx, T, wt, N, K, buf, N, threads)) return -1;
    ae_add_rms_norm(AE_BF16, buf, N, residual, N, out, N, norm, T, N, eps, threads);
    return 0;
}

/* A step's LoRA segments (ae_lora_add's rows, seg_rows and descs; tables[s] points at segment
 * s's adapter's [layers][AE_LORA_GROUPS][AE_LORA_FIELDS] descriptors); segs 0: none. */
struct lora_step {
    const int64_t *rows, *seg_rows, *tables;
    int64_t segs;
};

/* The deltas of layer l's group g, from its input x [T][K] into the parts' columns of y. */
static int lora_add(const struct lora_step *lo, int64_t l, int g, const void *x, int64_t K,
                    void *y, int64_t y_st, int64_t num_parts, const int64_t *cols,
                    const int64_t *widths, int threads) {
    if (lo->segs == 0) return 0;
    return ae_lora_add(AE_BF16, x, K, y, y_st, K, num_parts, cols, widths, lo->rows,
                       lo->seg_rows, lo->segs, lo->tables,
                       (l * AE_LORA_GROUPS + g) * AE_LORA_FIELDS, threads);
}

/* Over linear.c's or quantized weights, steps of up to AE_POOL_MAX_ROWS tokens run their
 * products and attention on its work pool (pool.c), where no thread waits for one that is not
 * running, and the small kernels between them (the first norm, rotary with the cache write: a few
 * microseconds at these sizes) in the calling thread, so that no OpenMP region shares the
 * cores with the pool's helpers, which spin for the next job meanwhile. Larger steps run every
 * kernel on OpenMP, as the products do (linear.c's use_pool). */
static int on_pool(const int64_t *p, int64_t T, int threads) {
    return threads > 1 && p[AE_LAYER_Q_KP] && T <= AE_POOL_MAX_ROWS;
}

int ae_decode_layers_bf16(const int64_t *layers, int64_t num_layers, int64_t T, int64_t hidden,
                          int64_t hq, int64_t hkv, int64_t d, int64_t inter, void *residual_,
                          void *scratch_, void *mlp_out_, const void *cos, const void *sin,
                          int64_t cs_st, const int64_t *slot_mapping, int64_t num_blocks,
                          int64_t block_size, const int64_t *q_start, const int32_t *q_lens,
                          const int32_t *seq_lens, const int32_t *block_table, int64_t bt_stride,
                          int64_t num_seqs, float eps, float head_eps, float scale,
                          const int64_t *lora_rows, const int64_t *lora_seg_rows,
                          int64_t lora_segs, const int64_t *lora_tables, int threads) {
    if (num_layers <= 0) return 0;
    const struct lora_step lora = {lora_rows, lora_seg_rows, lora_tables, lora_segs};
    const int64_t zero = 0, qkv_cols[3] = {0, hq * d, (hq + hkv) * d};
    const int64_t qkv_widths[3] = {hq * d, hkv * d, hkv * d}, gu_cols[2] = {0, inter};
    const int64_t gu_widths[2] = {inter, inter};
    uint16_t *residual = (uint16_t *)residual_, *mlp_out = (uint16_t *)mlp_out_;
    const int64_t qkv_w = (hq + 2 * hkv) * d, q_w = hq * d, kv_w = hkv * d;
    /* The scratch, in order: x [T, hidden], qkv [T, qkv_w], attn [T, q_w], o [T, hidden],
     * gate_up [T, 2 * inter], act [T, inter] (ae_decode_layers_scratch gives its size). */
    uint16_t *x = (uint16_t *)scratch_;
    uint16_t *qkv = x + T * hidden;
    uint16_t *attn = qkv + T * qkv_w;
    uint16_t *o = attn + T * q_w;
    uint16_t *gate_up = o + T * hidden;
    uint16_t *act = gate_up + T * 2 * inter;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *p = layers + l * AE_LAYER_FIELDS;
        const void *in_norm = (const void *)p[AE_LAYER_IN_NORM];
        const int pooled = on_pool(p, T, threads);
        const int small = pooled ? 1 : threads; /* the threads of the kernels between */
        if (l == 0) {
            ae_rms_norm(AE_BF16, residual, hidden, x, hidden, in_norm, T, hidden, eps,
                        small);
        } else { /* the layer before's down projection, its residual add and this norm */
            const int64_t *before = p - AE_LAYER_FIELDS;
            struct weight down =
                weight_at(before, AE_LAYER_DOWN_W, AE_LAYER_DOWN_B, AE_LAYER_DOWN_KP);
            if (lora.segs) {
                if (product(act, inter, T, down, hidden, inter, mlp_out, hidden, threads) ||
                    lora_add(&lora, l - 1, AE_LORA_DOWN, act, inter, mlp_out, hidden, 1, &zero,
                             &hidden, threads))
                    return -1;
                ae_add_rms_norm(AE_BF16, mlp_out, hidden, residual, hidden, x, hidden, in_norm,
                                T, hidden, eps, small);
            } else if (product_add_norm(act, inter, T, down, hidden, inter, mlp_out, residual,
                                        in_norm, eps, x, threads)) {
                return -1;
            }
        }
        struct weight q = weight_at(p, AE_LAYER_Q_W, AE_LAYER_Q_B, AE_LAYER_Q_KP);
        if (p[AE_LAYER_K_W] == 0) { /* q, k and v side by side in one weight */
            if (product(x, hidden, T, q, qkv_w, hidden, qkv, qkv_w, threads)) return -1;
        } else {
            struct weight k = weight_at(p, AE_LAYER_K_W, AE_LAYER_K_B, AE_LAYER_K_KP);
            struct weight v = weight_at(p, AE_LAYER_V_W, AE_LAYER_V_B, AE_LAYER_V_KP);
            if (product(x, hidden, T, q, q_w, hidden, qkv, qkv_w, threads) ||
                product(x, hidden, T, k, kv_w, hidden, qkv + q_w, qkv_w, threads) ||
                product(x, hidden, T, v, kv_w, hidden, qkv + q_w + kv_w, qkv_w, threads))
                return -1;
        }
        if (lora_add(&lora, l, AE_LORA_QKV, x, hidden, qkv, qkv_w, 3, qkv_cols, qkv_widths,
                     threads))
            return -1;
        void *cache = (void *)p[AE_LAYER_KV_CACHE];
        ae_rotary(AE_BF16, qkv, qkv_w, d, hq, qkv + q_w, qkv_w, d, hkv, cos, sin, cs_st, T, d,
                  (const void *)p[AE_LAYER_Q_NORM], (const void *)p[AE_LAYER_K_NORM], head_eps,
                  qkv + q_w + kv_w, qkv_w, d, cache, num_blocks, block_size, slot_mapping,
                  small);
        const int attended =
            pooled ? ae_paged_attention_pool(qkv, qkv_w, hq, attn, q_w, cache, hkv, num_blocks,
                                             block_size, d, q_start, q_lens, seq_lens,
                                             block_table, bt_stride, num_seqs, scale, threads)
                   : ae_paged_attention(AE_BF16, qkv, qkv_w, d, attn, q_w, d, cache, hkv,
                                        num_blocks, block_size, d, hq / hkv, q_start, q_lens,
                                        seq_lens, block_table, bt_stride, num_seqs, scale,
                                        threads);
        if (attended) return attended; /* -1: out of memory; -2: unsound tables */
        struct weight wo = weight_at(p, AE_LAYER_O_W, AE_LAYER_O_B, AE_LAYER_O_KP);
        const void *post_norm = (const void *)p[AE_LAYER_POST_NORM];
        if (lora.segs) {
            if (product(attn, q_w, T, wo, hidden, q_w, o, hidden, threads) ||
                lora_add(&lora, l, AE_LORA_O, attn, q_w, o, hidden, 1, &zero, &hidden, threads))
                return -1;
            ae_add_rms_norm(AE_BF16, o, hidden, residual, hidden, x, hidden, post_norm, T,
                            hidden, eps, small);
        } else if (product_add_norm(attn, q_w, T, wo, hidden, q_w, o, residual, post_norm, eps,
                                    x, threads)) {
            return -1;
        }
        struct weight gate = weight_at(p, AE_LAYER_GATE_W, AE_LAYER_GATE_B, AE_LAYER_GATE_KP);
        if (p[AE_LAYER_UP_W] == 0) { /* gate and up side by side in one weight */
            if (gate.kp > 0 && inter % 64 == 0 && !lora.segs) { /* linear.c's fused silu */
                ae_linear_silu_bf16(x, hidden, T, gate.w, 2 * inter, hidden, gate.kp, gate.b,
                                    act, inter, threads);
                continue;
            }
            if (product(x, hidden, T, gate, 2 * inter, hidden, gate_up, 2 * inter, threads))
                return -1;
        } else {
            struct weight up = weight_at(p, AE_LAYER_UP_W, AE_LAYER_UP_B, AE_LAYER_UP_KP);
            if (product(x, hidden, T, gate, inter, hidden, gate_up, 2 * inter, threads) ||
                product(x, hidden, T, up, inter, hidden, gate_up + inter, 2 * inter, threads))
                return -1;
        }
        if (lora_add(&lora, l, AE_LORA_GATE_UP, x, hidden, gate_up, 2 * inter, 2, gu_cols,
                     gu_widths, threads))
            return -1;
        ae_silu_mul(AE_BF16, gate_up, 2 * inter, gate_up + inter, 2 * inter, act, inter, T,
                    inter, threads);
    }
    /* The last layer's down projection, for the caller. */
    const int64_t *last = layers + (num_layers - 1) * AE_LAYER_FIELDS;
    struct weight down = weight_at(last, AE_LAYER_DOWN_W, AE_LAYER_DOWN_B, AE_LAYER_DOWN_KP);
    if (product(act, inter, T, down, hidden, inter, mlp_out, hidden, threads)) return -1;
    return lora_add(&lora, num_layers - 1, AE_LORA_DOWN, act, inter, mlp_out, hidden, 1, &zero,
                    &hidden, threads);
}

int64_t ae_decode_layers_scratch(int64_t T, int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                                 int64_t inter) {
    return T * (2 * hidden + (hq + 2 * hkv) * d + hq * d + 3 * inter);
}
