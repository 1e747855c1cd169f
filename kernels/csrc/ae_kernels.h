/*
 * asyncengine's native CPU kernels: every function the library exports, and the dtype codes.
 *
 * The .c files beside this header (one per kernel family: attention.c, rotary_cache.c,
 * norms.c, activation.c, argmax.c, bitmask.c, linear.c, lm_head_argmax.c, ...) are compiled
 * together into one shared library on first use by kernels/cpu_native.py, with the system C
 * compiler (`cc -O3 -march=native -fopenmp`), and called through ctypes: no torch headers,
 * about a second to build. Every .c file includes this header, and the Python bindings
 * (kernels/cpu_native.py) must match these declarations (tests/kernels/test_cpu_bindings.py
 * checks them).
 *
 * Tensors arrive as data pointers plus strides in elements; `dt` is the dtype of the tensors a
 * call reads and writes (one of the codes below); `num_threads` is the OpenMP team size to
 * use (torch's thread count: OpenMP's own setting is per thread). Each function's contract is
 * written above its definition.
 */
#ifndef AE_KERNELS_H
#define AE_KERNELS_H

#include <stdint.h>

/* Dtype codes: kernels/cpu_native.py's DTYPE_CODES. */
enum ae_dtype { AE_F32 = 0, AE_BF16 = 1, AE_F16 = 2 };

/* ---- Called from Python (ctypes) ---- */

/* attention.c: 0, or -2 where the tables are not sound (nothing written) */
int ae_paged_attention(int dt, const void *query, int64_t q_st, int64_t q_sh, void *out,
                       int64_t o_st, int64_t o_sh, const void *kv_cache, int64_t num_kv_heads,
                       int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t group,
                       const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens,
                       const int32_t *block_table, int64_t bt_stride, int64_t num_seqs,
                       float scale, int num_threads);

/* rotary_cache.c */
void ae_reshape_and_cache(int dt, const void *key, int64_t k_st, int64_t k_sh,
                          const void *value, int64_t v_st, int64_t v_sh, void *kv_cache,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                          int64_t head_dim, const int64_t *slot_mapping, int64_t num_tokens,
                          int num_threads);
void ae_rotary(int dt, void *q, int64_t q_st, int64_t q_sh, int64_t hq, void *k, int64_t k_st,
               int64_t k_sh, int64_t hkv, const void *cos, const void *sin, int64_t cs_st,
               int64_t T, int64_t D, const void *q_norm, const void *k_norm, float eps,
               const void *v, int64_t v_st, int64_t v_sh, void *kv_cache, int64_t num_blocks,
               int64_t block_size, const int64_t *slot_mapping, int num_threads);

/* norms.c */
void ae_rms_norm(int dt, const void *x, int64_t x_st, void *out, int64_t o_st,
                 const void *weight, int64_t rows, int64_t n, float eps, int num_threads);
void ae_add_rms_norm(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                     void *out, int64_t o_st, const void *weight, int64_t rows, int64_t n,
                     float eps, int num_threads);

/* activation.c */
void ae_silu_mul(int dt, const void *gate, int64_t g_st, const void *up, int64_t u_st, void *out,
                 int64_t o_st, int64_t rows, int64_t n, int num_threads);

/* argmax.c */
int64_t ae_argmax_rows(int dt, const void *x, int64_t x_st, int64_t rows, int64_t n,
                       int64_t *out, int num_threads);

/* bitmask.c */
void ae_apply_bitmask(int dt, void *x, int64_t x_st, const int64_t *rows, int64_t n_rows,
                      const int32_t *mask, int64_t mask_st, int64_t n, int num_threads);

/* linear_dense.c (bf16 over weights in 16-row k-major panels, fp32 FMAs; 0 on success, -1
 * when out of memory) */
int ae_linear_dense_simd(void);
int ae_linear_bf16_dense(const void *x, int64_t x_st, int64_t M, const void *w, int64_t N,
                         int64_t K, const void *bias, void *out, int64_t o_st, int num_threads);
void ae_dense_panel_order(int32_t *order);

/* linear.c (bf16 only, over oneDNN's packed weights) */
/* decode_layers.c: the lean forward's decoder layers in one call. `layers` is [num_layers]
 * rows of AE_LAYER_FIELDS addresses (0 for absent: a joint q/k/v weight leaves K_W and V_W 0,
 * a joint gate/up weight leaves UP_W 0; biases and Qwen3's head norms may be 0). A weight's
 * *_KP field says which kernel reads it: 0, linear_dense.c's panels; > 0, linear.c's blocks,
 * with that padded input extent; < 0, GGUF blocks of ae_linear_quant's format -KP - 1 (its
 * bias bf16). A step with LoRA rows passes their segments (lora.c's ae_lora_add's rows,
 * seg_rows, and per segment its adapter's [num_layers][AE_LORA_GROUPS][AE_LORA_FIELDS]
 * descriptors); lora_segs 0: none. 0 on success, -1 when out of memory, -2 where the
 * attention's tables are not sound (attention.c's tables_sound). */
enum ae_layer_field {
    AE_LAYER_IN_NORM, AE_LAYER_POST_NORM, AE_LAYER_Q_W, AE_LAYER_K_W, AE_LAYER_V_W,
    AE_LAYER_Q_B, AE_LAYER_K_B, AE_LAYER_V_B, AE_LAYER_O_W, AE_LAYER_O_B, AE_LAYER_GATE_W,
    AE_LAYER_UP_W, AE_LAYER_GATE_B, AE_LAYER_UP_B, AE_LAYER_DOWN_W, AE_LAYER_DOWN_B,
    AE_LAYER_Q_NORM, AE_LAYER_K_NORM, AE_LAYER_KV_CACHE, AE_LAYER_Q_KP, AE_LAYER_K_KP,
    AE_LAYER_V_KP, AE_LAYER_O_KP, AE_LAYER_GATE_KP, AE_LAYER_UP_KP, AE_LAYER_DOWN_KP,
    AE_LAYER_FIELDS
};
int ae_decode_layers_bf16(const int64_t *layers, int64_t num_layers, int64_t T, int64_t hidden,
                          int64_t hq, int64_t hkv, int64_t d, int64_t inter, void *residual,
                          void *scratch, void *mlp_out, const void *cos, const void *sin,
                          int64_t cs_st, const int64_t *slot_mapping, int64_t num_blocks,
                          int64_t block_size, const int64_t *q_start, const int32_t *q_lens,
                          const int32_t *seq_lens, const int32_t *block_table, int64_t bt_stride,
                          int64_t num_seqs, float eps, float head_eps, float scale,
                          const int64_t *lora_rows, const int64_t *lora_seg_rows,
                          int64_t lora_segs, const int64_t *lora_tables, int num_threads);
int64_t ae_decode_layers_scratch(int64_t T, int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                                 int64_t inter);

/* lora.c: y += each segment's low-rank product x @ A^T @ B^T (Punica's shrink and expand) on
 * the rows of `rows` (segment s: rows[seg_rows[s] .. seg_rows[s + 1]]), with segment s's
 * weights described by the AE_LORA_FIELDS int64 at (const int64_t *)descs[s] + desc_offset;
 * 0 on success, -1 when out of memory, -2 for a bad descriptor. A descriptor: A [R][K]
 * (the group's parts' lora_A stacked; 0: nothing to add), R, the weights' dtype code (fp32 or
 * bf16), then per part p < 3: B_p^T [r_p][width_p] times the scale (0: not adapted), the
 * first of A's rows it reads, r_p. decode_layers.c's tables hold one per (layer, group). */
enum ae_lora_field {
    AE_LORA_A, AE_LORA_RANK, AE_LORA_WDT, AE_LORA_B0, AE_LORA_LO0, AE_LORA_R0, AE_LORA_B1,
    AE_LORA_LO1, AE_LORA_R1, AE_LORA_B2, AE_LORA_LO2, AE_LORA_R2, AE_LORA_FIELDS
};
enum ae_lora_group { AE_LORA_QKV, AE_LORA_O, AE_LORA_GATE_UP, AE_LORA_DOWN, AE_LORA_GROUPS };
int ae_lora_add(int dt, const void *x, int64_t x_st, void *y, int64_t y_st, int64_t K,
                int64_t num_parts, const int64_t *part_cols, const int64_t *part_widths,
                const int64_t *rows, const int64_t *seg_rows, int64_t num_segs,
                const int64_t *descs, int64_t desc_offset, int num_threads);

int ae_linear_bf16_fast(void);
/* pool.c: wait (up to timeout_ms) until no pool helper is inside an item (1), else 0; before
 * freeing what pool jobs read (see pool.c) */
int ae_pool_quiesce(int timeout_ms);
/* pool.c, tests: 1 makes every job wait for its helpers to leave its items before it returns
 * (initially $ASYNCENGINE_POOL_STRICT=1); returns the previous setting */
int ae_pool_set_strict(int on);
/* pool.c: this thread's OpenMP team size for later regions (omp_set_num_threads, which is
 * what torch.set_num_threads calls, without its other effects); returns the size before */
int ae_omp_set_threads(int n);
/* pool.c, for tests: helpers sleep `ns` after claiming an item, as if preempted there; returns
 * how many items the calling thread took over from helpers since the last call */
int64_t ae_pool_test_delay_helpers(int64_t ns);
void ae_linear_bf16(const void *x, int64_t x_st, int64_t M, const void *w, int64_t N, int64_t K,
                    int64_t Kp, const void *bias, void *out, int64_t o_st, int num_threads);
void ae_linear_silu_bf16(const void *x, int64_t x_st, int64_t M, const void *w, int64_t N,
                         int64_t K, int64_t Kp, const void *bias, void *out, int64_t o_st,
                         int num_threads);
void ae_linear_add_rms_norm_bf16(const void *x, int64_t x_st, int64_t M, const void *w,
                                 int64_t N, int64_t K, int64_t Kp, const void *bias,
                                 void *product, void *residual, int64_t r_st,
                                 const void *norm_weight, float eps, void *out, int64_t o_st,
                                 int num_threads);

/* lm_head_argmax.c: the greedy (or Gumbel-max sampled) token of an lm_head product, screened
 * by an int8 copy of its weight; returns how many 64-column blocks it computed exactly */
int64_t ae_lm_head_argmax_bf16(const void *x, int64_t x_st, int64_t M, const int8_t *q,
                               const float *scale, const float *rnorm, const void *w, int64_t K,
                               int64_t Kp, const void *bias, int64_t vocab, const float *temps,
                               const float *noise, int64_t noise_st, int64_t *out,
                               int num_threads);
/* lm_head_argmax.c: the int8 copy that ae_lm_head_argmax_bf16 screens with, from the packed W */
void ae_lm_head_quantize(const void *w, int64_t N, int64_t K, int64_t Kp, int8_t *q, float *scale,
                         float *rnorm, int num_threads);

/* quant_legacy.c: products over GGUF's block-quantized weights with x's rows quantized to
 * int8 blocks of 32 (ae_linear_quant: 0 on success, -1 when out of memory, -2 when K is not a
 * multiple of the block, -3 for a format not run); the formats it runs; the activation
 * quantization; which paths were built, and the one to take */
int ae_quant_paths(void);
int ae_quant_set_path(int path);
/* the paths' numbers (ae_quant_set_path(-2) returns the one in effect) */
#define AE_QUANT_PATH_SCALAR 0
#define AE_QUANT_PATH_AVX2 1
#define AE_QUANT_PATH_VNNI 2
void ae_quantize_rows_q8(int dt, const void *x, int64_t x_st, int64_t M, int64_t K, int8_t *qs,
                         float *d, int num_threads);
void ae_quantize_rows_q8k(int dt, const void *x, int64_t x_st, int64_t M, int64_t K, int8_t *qs,
                          float *d, int num_threads);
/* Format codes as quant_formats.FORMATS: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1 (blocks of
 * 32, quant_legacy.c), 5 Q4_K, 6 Q5_K, 7 Q6_K (super-blocks of 256, quant_kquants.c), 8 Q4_K,
 * 9 Q8_0, 10 Q5_0, 11 Q4_0 and 12 Q6_K with every 8 rows interleaved (quant_r8.c), 13 Q5_0's
 * values one byte each (Q5_0_BYTES: Q8_0's block, d and 32 int8 q - 16 in -16 .. 15; the AVX2
 * machines' layout of Q5_0, whose one-row products read it ~1.5x faster). */
#define AE_QUANT_Q8_0 0
#define AE_QUANT_Q4_K 5
#define AE_QUANT_Q4_K_R8 8
#define AE_QUANT_Q8_0_R8 9
#define AE_QUANT_Q5_0_R8 10
#define AE_QUANT_Q4_0_R8 11
#define AE_QUANT_Q6_K_R8 12
#define AE_QUANT_Q5_0_BYTES 13
#define AE_QUANT_FORMATS 14 /* codes 0 .. this - 1 */
/* an 8-row interleaved format (quant_r8.c) */
#define AE_QUANT_IS_R8(fmt) ((fmt) >= AE_QUANT_Q4_K_R8 && (fmt) <= AE_QUANT_Q6_K_R8)
int ae_quant_formats(void);
int ae_linear_quant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                    int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                    int num_threads);

/* quant_gemm.c: ae_linear_quant's product on AVX512-VNNI over weights unpacked a panel at a
 * time, for several rows of x (the same arguments and returns; -3 where the build has no
 * AVX512-VNNI); ae_linear_quant takes it from ae_quant_gemm_min_rows(fmt) rows of format fmt
 * on the VNNI path (0: never) */
int ae_quant_gemm(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                  int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                  int num_threads);
int ae_quant_gemm_min_rows(int fmt);
/* quant_gemm_f32.c: from how many rows ae_quant_gemm multiplies format fmt's weights
 * dequantized to fp32 by x unquantized, on the path in effect (0: never; AVX2's Q8_0 where
 * turned on); ae_quant_gemm_f32_set turns that on (1), off (0) or to the CPU's default (-1)
 * for the process, or (-2) changes nothing; returns whether it is on. */
int ae_quant_gemm_f32_min_rows(int fmt);
int ae_quant_gemm_f32_set(int on);

/* quant_r8.c: the file's rows [N][K / values * bytes] of the format interleaved format fmt
 * (8-12) is made from (Q4_K, Q8_0, Q5_0, Q4_0, Q6_K) in fmt's layout and back, the same number of
 * bytes; N a multiple of 8 and K of the block's values (0; -2 otherwise; -3 for another
 * fmt); the bytes come back exactly */
int ae_repack_r8(int fmt, const void *src, void *dst, int64_t N, int64_t K, int num_threads);
int ae_unpack_r8(int fmt, const void *src, void *dst, int64_t N, int64_t K, int num_threads);

/* quant_dequant.c: W's N rows of GGUF blocks (format code fmt) as dtype dt (0 fp32, 1 bf16,
 * 2 fp16) rows of stride o_st in out: 0 on success, -2 when K is not a multiple of the block,
 * -3 for an unknown format, -4 for an unknown dtype */
int ae_dequantize_quant(int fmt, const void *w, int64_t N, int64_t K, int dt, void *out,
                        int64_t o_st, int num_threads);

/* ---- Shared between the .c files, not called from Python ---- */

/* quant_kquants.c: ae_linear_quant's K-quant formats, and which of them it runs (bit f:
 * format code f) */
int ae_kquant_formats(void);
int ae_linear_kquant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                     int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                     int num_threads);

/* quant_r8.c: ae_linear_quant for formats 8 to 12 (the same arguments and returns; -2 also
 * where N is not a multiple of 8) */
int ae_linear_r8(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                 int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                 int num_threads);

/* attention.c: ae_paged_attention of bf16 on linear.c's work pool (pool.c), for
 * decode_layers.c: query [T][hq * head_dim] rows of stride q_st, out of stride o_st (heads
 * contiguous). 0 on success, -1 when out of memory, -2 where the tables are not sound. */
int ae_paged_attention_pool(const void *query, int64_t q_st, int64_t hq, void *out,
                            int64_t o_st, const void *kv_cache, int64_t num_kv_heads,
                            int64_t num_blocks, int64_t block_size, int64_t head_dim,
                            const int64_t *q_start, const int32_t *q_lens,
                            const int32_t *seq_lens, const int32_t *block_table,
                            int64_t bt_stride, int64_t num_seqs, float scale, int num_threads);

/* norms.c: row r of ae_add_rms_norm in the calling thread (linear.c's fused norm runs it). */
void ae_add_rms_norm_row(int dt, const void *x, int64_t x_st, void *residual, int64_t r_st,
                         void *out, int64_t o_st, const float *w, float *buf, float *other,
                         int64_t r, int64_t n, float eps);

/* norms.c: RMSNorm of one fp32 row in place (rotary_cache.c's per-head norms run it). Hidden:
 * not exported from the library, so calls to it are direct. */
__attribute__((visibility("hidden"))) void rms_norm_row(float *restrict buf,
                                                        const float *restrict w, int64_t n,
                                                        float eps, int dt);

#endif
