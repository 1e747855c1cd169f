/*
 * GGUF block-quantized weights read back as fp32, bf16 or fp16 rows: for products of many rows
 * (prefill chunks, large decode batches), where multiplying the dequantized rows with the
 * float GEMM costs less than quantizing the activations and summing block by block. The
 * caller keeps the result only for the one product (a scratch buffer), so the weights stay
 * quantized in memory.
 *
 * Each block is decoded into fp32 exactly as ggml's dequantize_row_<type> decodes it (the
 * same products in the same order: the values equal gguf-py's and quant_formats.dequantize's),
 * then rounded once to the output dtype. The loops are plain C over one block at a time, which
 * GCC vectorizes; rows are split between OpenMP threads.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
/* Products and sums with their rounding given: GCC may otherwise fuse a multiply and an add
 * into one FMA (one rounding), and the values would no longer be gguf-py's. */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif

#include "ae_kernels.h"
#include "bf16.h"
#include "kquant_blocks.h"

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Values and bytes per block of each format code (quant_formats.FORMATS' order). */
static const int VALUES[8] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int BYTES[8] = {34, 18, 20, 22, 24, 144, 176, 210};

static void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of format `fmt` at b, decoded into y (VALUES[fmt] floats). */
static void dequant_block(int fmt, const uint8_t *b, float *y) {
    switch (fmt) {
    case 0: { /* Q8_0: d, qs[32] */
        const float d = f16_to_f32(rd16(b));
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
        break;
    }
    case 1: { /* Q4_0: d, qs[16] */
        const float d = f16_to_f32(rd16(b));
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((qs[j] & 0x0F) - 8) * d;
            y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
        break;
    }
    case 2: { /* Q4_1: d, m, qs[16] */
        const float d = f16_to_f32(rd16(b)), m = f16_to_f32(rd16(b + 2));
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(qs[j] & 0x0F) * d + m;
            y[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
        break;
    }
    case 3: { /* Q5_0: d, qh[4], qs[16] */
        const float d = f16_to_f32(rd16(b));
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            const uint8_t xh0 = (uint8_t)(((qh >> j) << 4) & 0x10);
            const uint8_t xh1 = (uint8_t)((qh >> (j + 12)) & 0x10);
            y[j] = (float)(((qs[j] & 0x0F) | xh0) - 16) * d;
            y[j + 16] = (float)(((qs[j] >> 4) | xh1) - 16) * d;
        }
        break;
    }
    case 4: { /* Q5_1: d, m, qh[4], qs[16] */
        const float d = f16_to_f32(rd16(b)), m = f16_to_f32(rd16(b + 2));
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
            const uint8_t xh0 = (uint8_t)(((qh >> j) << 4) & 0x10);
            const uint8_t xh1 = (uint8_t)((qh >> (j + 12)) & 0x10);
            y[j] = (float)((qs[j] & 0x0F) | xh0) * d + m;
            y[j + 16] = (float)((qs[j] >> 4) | xh1) * d + m;
        }
        break;
    }
    case 5: { /* Q4_K: d, dmin, scales[12], qs[128] */
        const float d = f16_to_f32(rd16(b)), dmin = f16_to_f32(rd16(b + 2));
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
            uint8_t sc, m;
            get_scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            get_scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) y[j + l] = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (float)(q[l] >> 4) - m2;
            q += 32;
        }
        break;
    }
    case 6: { /* Q5_K: d, dmin, scales[12], qh[32], qs[128] */
        const float d = f16_to_f32(rd16(b)), dmin = f16_to_f32(rd16(b + 2));
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
            uint8_t sc, m;
            get_scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            get_scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                y[j + l] = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++)
                y[j + 32 + l] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            ql += 32;
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
        break;
    }
    case 7: { /* Q6_K: ql[128], qh[64], scales[16] (int8), d */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_to_f32(rd16(b + 208));
        for (int n = 0; n < 256; n += 128) {
            for (int is = 0; is < 2; is++) { /* 16 values of each of the four rows share a scale */
                const float s1 = d * sc[is], s2 = d * sc[is + 2];
                const float s3 = d * sc[is + 4], s4 = d * sc[is + 6];
                for (int l = is * 16; l < is * 16 + 16; l++) {
                    const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[n + l] = s1 * (float)q1;
                    y[n + l + 32] = s2 * (float)q2;
                    y[n + l + 64] = s3 * (float)q3;
                    y[n + l + 96] = s4 * (float)q4;
                }
            }
            ql += 64;
            qh += 32;
            sc += 8;
        }
        break;
    }
    }
}

#ifdef HAVE_AVX512
/* A block of 32 values (formats 0-4) decoded as dequant_block decodes it, with AVX512: the
 * block's q as 32 bytes in element order (the low nibbles are elements 0-15, the high ones
 * 16-31, and qh's bit j is element j's fifth bit), then the same products. */
static inline void dequant_block32(int fmt, const uint8_t *b, float *y) {
    const int has_m = fmt == 2 || fmt == 4, has_h = fmt == 3 || fmt == 4;
    __m256i q;
    if (fmt == 0) {
        q = _mm256_loadu_si256((const __m256i *)(b + 2));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * has_m + 4 * has_h));
        const __m128i m4 = _mm_set1_epi8(15);
        q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        if (has_h) {
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * has_m, 4);
            q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
        }
        if (fmt == 1) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        if (fmt == 3) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    }
    const __m512 d = _mm512_set1_ps(f16_to_f32(rd16(b)));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    lo = _mm512_mul_round_ps(lo, d, RN);
    hi = _mm512_mul_round_ps(hi, d, RN);
    if (has_m) {
        const __m512 m = _mm512_set1_ps(f16_to_f32(rd16(b + 2)));
        lo = _mm512_add_round_ps(lo, m, RN);
        hi = _mm512_add_round_ps(hi, m, RN);
    }
    _mm512_storeu_ps(y, lo);
    _mm512_storeu_ps(y + 16, hi);
}
#endif

/* n values of y (a multiple of 16) rounded to bf16 into o, as f32_to_bf16 rounds each. */
static inline void store_bf16(const float *y, uint16_t *o, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512BF16__)
    /* (denormals would flush to zero here; a block's values are never that small: products
     * of fp16 scales and small integers) */
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(o + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(y + j)));
#elif defined(__AVX2__)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(o + j), round8_bf16(_mm256_loadu_ps(y + j)));
#endif
    for (; j < n; j++) o[j] = f32_to_bf16(y[j]);
}

int ae_dequantize_quant(int fmt, const void *w, int64_t N, int64_t K, int dt, void *out,
                        int64_t o_st, int num_threads) {
    if (fmt < 0 || fmt >= AE_QUANT_FORMATS) return -3;
    if (dt < 0 || dt > 2) return -4;
    if (fmt == AE_QUANT_Q5_0_BYTES) fmt = 0; /* Q8_0's blocks, with smaller values */
    /* the interleaved formats: a row at a time from its group, as the file's blocks */
    const int r8 = AE_QUANT_IS_R8(fmt) ? fmt : 0;
    const int64_t gb = r8 ? r8_group_bytes(r8) : 0;
    if (r8) fmt = r8_source_format(r8);
    const int64_t values = VALUES[fmt], nb = K / values;
    if (K <= 0 || K % values || (r8 && N % 8)) return -2;
    const int64_t row_bytes = nb * BYTES[fmt];
#pragma omp parallel num_threads(num_threads) if (N * K >= 65536)
    {
        float y[256];
        uint8_t blk[256]; /* an interleaved row's block as the file's (up to Q6_K's 210) */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = (const uint8_t *)w + n * row_bytes;
            for (int64_t i = 0; i < nb; i++) {
                if (r8) {
                    const uint8_t *g = (const uint8_t *)w + ((n / 8) * nb + i) * gb;
                    if (r8 == AE_QUANT_Q4_K_R8) q4k_r8_block(g, (int)(n % 8), blk);
                    else if (r8 == AE_QUANT_Q8_0_R8) q8r8_block(g, (int)(n % 8), blk);
                    else if (r8 == AE_QUANT_Q6_K_R8) q6kr8_block(g, (int)(n % 8), blk);
                    else q50r8_block(g, (int)(n % 8), r8 == AE_QUANT_Q5_0_R8, blk);
                    dequant_block(fmt, blk, y);
                } else
#ifdef HAVE_AVX512
                if (fmt < 5) dequant_block32(fmt, row + i * BYTES[fmt], y);
                else
#endif
                    dequant_block(fmt, row + i * BYTES[fmt], y);
                const int64_t at = n * o_st + i * values;
                if (dt == 0) {
                    memcpy((float *)out + at, y, (size_t)values * 4);
                } else if (dt == 1) {
                    store_bf16(y, (uint16_t *)out + at, values);
                } else {
                    _Float16 *o = (_Float16 *)out + at;
                    for (int64_t j = 0; j < values; j++) o[j] = (_Float16)y[j];
                }
            }
        }
    }
    return 0;
}
