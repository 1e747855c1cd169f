/*
 * Reading GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K; layouts at quant_kquants.c's top),
 * shared by quant_kquants.c's tiles and quant_gemm.c's panels: the 6-bit scales and mins, and
 * the 256 unsigned values in element order. Static and forced inline, as ae_vec.h's helpers.
 */
#ifndef AE_KQUANT_BLOCKS_H
#define AE_KQUANT_BLOCKS_H

#include <stdint.h>

#include "ae_kernels.h"
#include "ae_vec.h"

enum { FMT_Q4_K = AE_QUANT_Q4_K, FMT_Q5_K = AE_QUANT_Q4_K + 1, FMT_Q6_K = AE_QUANT_Q4_K + 2 };

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

#endif
