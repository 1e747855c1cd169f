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
    FMT_Q5_0_R8 = AE_QUANT_Q5_0_R8,
    FMT_Q4_0_R8 = AE_QUANT_Q4_0_R8,
    FMT_Q6_K_R8 = AE_QUANT_Q6_K_R8,
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
 * Q4_K_R8: Q4_K weights with every 8 rows interleaved (ae_repack_r8, quant_r8.c; the
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

/* Where value v of row r sits in its step's 64 bytes (Q8_0_R8, Q5_0_R8, Q4_0_R8): step v / 8,
 * byte 4L + e, lane L = 2r + h, the value 8s + 4h + e. */
static ALWAYS_INLINE int r8_lane_byte(const int v, const int r) {
    return 4 * (2 * r + (v % 8) / 4) + v % 4;
}

/* Q8_0_R8 (quant_r8.c): rows 8g..8g+7's block b (32 values) is one group block of Q8R8_BYTES
 * at w + (g * nb + b) * Q8R8_BYTES, nb = K / 32. */
#define Q8R8_BYTES 272

/* Row r of a Q8_0_R8 group block as the Q8_0 block it was made from (34 bytes). */
static ALWAYS_INLINE void q8r8_block(const uint8_t *g, const int r, uint8_t *restrict blk) {
    memcpy(blk, g + 2 * r, 2);
    for (int v = 0; v < 32; v++)
        blk[2 + v] = (uint8_t)(g[16 + 64 * (v / 8) + r8_lane_byte(v, r)] ^ 0x80);
}

/* Q5_0_R8 and Q4_0_R8 (quant_r8.c): rows 8g..8g+7's block b (32 values) is one group block
 * at w + (g * nb + b) * Q50R8_BYTES (8 x 22) or Q40R8_BYTES (8 x 18), nb = K / 32. */
#define Q50R8_BYTES 176
#define Q40R8_BYTES 144

/* Row r's 32 values u of a Q5_0_R8 (hb 1: u = q + 16, 0..31) or Q4_0_R8 (hb 0: q + 8) group
 * block: step s's low 4 bits in chunk s / 2 (low nibbles s even, high odd), its fifth bits
 * the 64-bit mask at 144 + 8s. */
static ALWAYS_INLINE void q50r8_values(const uint8_t *g, const int r, const int hb,
                                       uint8_t *restrict u) {
    for (int v = 0; v < 32; v++) {
        const int s = v / 8, p = r8_lane_byte(v, r);
        const uint8_t n = g[16 + 64 * (s / 2) + p];
        u[v] = (uint8_t)(s % 2 ? n >> 4 : n & 15);
        if (hb) u[v] |= (uint8_t)(((g[144 + 8 * s + p / 8] >> (p % 8)) & 1) << 4);
    }
}

/* Row r of a Q5_0_R8 (hb 1) or Q4_0_R8 (hb 0) group block as the Q5_0 / Q4_0 block it was
 * made from (22 / 18 bytes: d, Q5_0's qh, qs with elements j and j + 16 in qs[j]). */
static ALWAYS_INLINE void q50r8_block(const uint8_t *g, const int r, const int hb,
                                      uint8_t *restrict blk) {
    uint8_t u[32];
    q50r8_values(g, r, hb, u);
    memcpy(blk, g + 2 * r, 2);
    uint8_t *qs = blk + 2 + 4 * hb;
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((u[j] & 15) | ((u[j + 16] & 15) << 4));
    if (hb) {
        uint32_t qh = 0;
        for (int j = 0; j < 32; j++) qh |= (uint32_t)(u[j] >> 4) << j;
        memcpy(blk + 2, &qh, 4);
    }
}

/* Q6_K_R8 (quant_r8.c): rows 8g..8g+7's super-block b is one group block of Q6KR8_BYTES
 * (8 x 210) at w + (g * nsb + b) * Q6KR8_BYTES, nsb = K / 256. */
#define Q6KR8_BYTES 1680

/* Where a Q6_K_R8 group block's chunks are: low-bit chunk c (steps 2c, 2c + 1) and high-bit
 * chunk c (steps 4c .. 4c + 3), in 8 parts of 192 bytes from 144, part p holding low chunks
 * 2p and 2p + 1, then high chunk p: the tile reads the block from start to end, which the
 * hardware's prefetch follows (with all the high chunks after the low ones, the product of a
 * weight read from memory ran at 10 GB/s on one Zen 4 core, the file's layout at 24). */
static ALWAYS_INLINE int q6kr8_low(const int c) { return 144 + 192 * (c / 2) + 64 * (c % 2); }
static ALWAYS_INLINE int q6kr8_high(const int c) { return 144 + 192 * c + 128; }

/* Row r's 256 values u (q + 32, 0..63) and 16 int8 scales of a Q6_K_R8 group block: step t's
 * low 4 bits in low chunk t / 2 (low nibbles t even, high odd), its high 2 bits at bits
 * 2 (t % 4) of high chunk t / 4, both in Q8_0_R8's lane layout; scale j at 16 + 8j + r. */
static ALWAYS_INLINE void q6kr8_values(const uint8_t *g, const int r, uint8_t *restrict u,
                                       int8_t *restrict sc) {
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)g[16 + 8 * j + r];
    for (int v = 0; v < 256; v++) {
        const int t = v / 8, p = r8_lane_byte(v, r);
        const uint8_t n = g[q6kr8_low(t / 2) + p], h = g[q6kr8_high(t / 4) + p];
        u[v] = (uint8_t)((t % 2 ? n >> 4 : n & 15) | (((h >> (2 * (t % 4))) & 3) << 4));
    }
}

/* Row r of a Q6_K_R8 group block as the Q6_K super-block it was made from (210 bytes: ql[128],
 * qh[64], scales[16], d; unpack_sb's order inverted). */
static ALWAYS_INLINE void q6kr8_block(const uint8_t *g, const int r, uint8_t *restrict blk) {
    uint8_t u[256];
    int8_t sc[16];
    q6kr8_values(g, r, u, sc);
    for (int h = 0; h < 2; h++) {
        uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        const uint8_t *o = u + 128 * h;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((o[l] & 15) | ((o[l + 64] & 15) << 4));
            ql[l + 32] = (uint8_t)((o[l + 32] & 15) | ((o[l + 96] & 15) << 4));
            qh[l] = (uint8_t)((o[l] >> 4) | ((o[l + 32] >> 4) << 2) | ((o[l + 64] >> 4) << 4) |
                              ((o[l + 96] >> 4) << 6));
        }
    }
    memcpy(blk + 192, sc, 16);
    memcpy(blk + 208, g + 2 * r, 2);
}

/* The interleaved format fmt's file format (-1: fmt is none) and group block bytes. */
static inline int r8_source_format(const int fmt) {
    return fmt == FMT_Q4_K_R8   ? FMT_Q4_K
           : fmt == FMT_Q8_0_R8 ? 0
           : fmt == FMT_Q5_0_R8 ? 3
           : fmt == FMT_Q4_0_R8 ? 1
           : fmt == FMT_Q6_K_R8 ? FMT_Q6_K
                                : -1;
}
static inline int64_t r8_group_bytes(const int fmt) {
    return fmt == FMT_Q4_K_R8   ? Q4K_R8_BYTES
           : fmt == FMT_Q8_0_R8 ? Q8R8_BYTES
           : fmt == FMT_Q5_0_R8 ? Q50R8_BYTES
           : fmt == FMT_Q4_0_R8 ? Q40R8_BYTES
                                : Q6KR8_BYTES;
}

#endif
