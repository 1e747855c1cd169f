/* The helpers of the native kernels' inner loops, shared by several .c files: 16-lane fp32
 * vectors, rows of any supported dtype widened to fp32 and rounded back, bf16 rounding of 16
 * lanes at once. Every one is `static` and forced inline (ALWAYS_INLINE): each file that
 * includes this header gets its own inlined copies, as when all kernels were one file. */
#ifndef AE_VEC_H
#define AE_VEC_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "ae_kernels.h"
#include "bf16.h"

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

#endif
