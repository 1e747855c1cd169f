/*
 * Reading GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K; layouts at quant_kquants.c's top),
 * shared by quant_kquants.c's tiles and quant_gemm.c's panels: the 6-bit scales and mins, and
 * the 256 unsigned values in element order. Static and forced inline, as ae_vec.h's helpers.
 */
#ifndef AE_KQUANT_BLOCKS_H
#define AE_KQUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "ae_kernels.h"
#include "ae_vec.h"

enum {
    FMT_Q4_K = AE_QUANT_Q4_K,
    FMT_Q5_K = AE_QUANT_Q4_K + 1,
    FMT_Q6_K = AE_QUANT_Q4_K + 2,
    FMT_Q4_K_R8 = AE_QUANT_Q4_K_R8,
    FMT_Q8_0_R8 = AE_QUANT_Q8_0_R8,
    QK4K_VALUES = 256
};

/* Q4_K / Q5_K's 12 scale bytes as 8 scales and 8 mins (get_scale_min_k4), byte by byte. */
static ALWAYS_INLINE void k4_scales(const uint8_t *s, uint8_t *restrict sc, uint8_t *restrict m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* One super-block's 256 values q (unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) in order. */
static ALWAYS_INLINE void unpack_sb(int fmt, const uint8_t *blk, uint8_t *restrict q) {
    if (fmt == FMT_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            uint8_t *o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        return;
    }
    const uint8_t *qs = blk + (fmt == FMT_Q4_K ? 16 : 48), *qh = blk + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
            if (fmt == FMT_Q5_K) {
                lo = (uint8_t)(lo | (((qh[l] >> (2 * c)) & 1) << 4));
                hi = (uint8_t)(hi | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
            q[64 * c + l] = lo;
            q[64 * c + 32 + l] = hi;
        }
}

/*
 * Q4_K_R8: Q4_K weights with every 8 rows interleaved (ae_repack_q4_k_r8, quant_r8.c; the
 * layout is described there). Rows 8g..8g+7's super-block b is one group block of
 * Q4K_R8_BYTES at w + (g * nsb + b) * Q4K_R8_BYTES, nsb = K / 256: the same bytes per row as
 * Q4_K, so that N rows still take N * K / 256 * 144 bytes and whole groups of rows slice.
 */
#define Q4K_R8_BYTES 1152

/* The 6-bit scale and min of row r's sub-block j in a group block, e = 8j + r. */
static ALWAYS_INLINE void q4k_r8_scale_min(const uint8_t *g, const int e, uint8_t *restrict sc,
                                           uint8_t *restrict m) {
    const int a = g[32 + e], nib = g[96 + e % 32] >> (e < 32 ? 0 : 4);
    *sc = (uint8_t)(a & 63);
    *m = (uint8_t)(((a >> 6) << 4) | (nib & 15));
}

/* Row r's sc, m (8 each) and values (256, 0..15, in element order) of a group block. */
static ALWAYS_INLINE void q4k_r8_unpack(const uint8_t *g, const int r, uint8_t *restrict sc,
                                        uint8_t *restrict m, uint8_t *restrict q) {
    for (int j = 0; j < 8; j++) q4k_r8_scale_min(g, 8 * j + r, &sc[j], &m[j]);
    for (int c = 0; c < 16; c++) /* chunk c: steps 2c (low nibbles) and 2c + 1 (high) */
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 4; e++) {
                const uint8_t v = g[128 + 64 * c + 4 * (2 * r + h) + e];
                q[16 * c + 4 * h + e] = v & 15;
                q[16 * c + 8 + 4 * h + e] = v >> 4;
            }
}

/* Row r of a group block as the Q4_K super-block it was made from (the same 144 bytes). */
static ALWAYS_INLINE void q4k_r8_block(const uint8_t *g, const int r, uint8_t *restrict blk) {
    uint8_t sc[8], m[8], q[QK4K_VALUES];
    q4k_r8_unpack(g, r, sc, m, q);
    memcpy(blk, g + 2 * r, 2);
    memcpy(blk + 2, g + 16 + 2 * r, 2);
    for (int j = 0; j < 4; j++) { /* get_scale_min_k4's packing, inverted */
        blk[4 + j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        blk[8 + j] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
        blk[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            blk[16 + 32 * c + l] = (uint8_t)(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
}

/* Q8_0_R8 (quant_r8.c): rows 8g..8g+7's block b (32 values) is one group block of Q8R8_BYTES
 * at w + (g * nb + b) * Q8R8_BYTES, nb = K / 32. */
#define Q8R8_BYTES 272

/* Row r of a Q8_0_R8 group block as the Q8_0 block it was made from (34 bytes). */
static ALWAYS_INLINE void q8r8_block(const uint8_t *g, const int r, uint8_t *restrict blk) {
    memcpy(blk, g + 2 * r, 2);
    for (int v = 0; v < 32; v++)
        blk[2 + v] = (uint8_t)(g[16 + 64 * (v / 8) + 4 * (2 * r + (v % 8) / 4) + v % 4] ^ 0x80);
}

#endif
