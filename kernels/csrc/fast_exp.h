/* exp() for the native CPU kernels, in forms that loops vectorise (shared by the attention
 * softmax, SiLU-and-multiply and the linear kernel's fused SiLU epilogue, so that each gives
 * the same numbers wherever it runs). */
#ifndef AE_FAST_EXP_H
#define AE_FAST_EXP_H

#include <stdint.h>

/* 2^y for y in [-126, 127], written so that loops over it vectorise: 2^n * 2^f with |f| <= 1/2
 * and a degree-7 Taylor polynomial for 2^f (relative error below 1e-7, under fp32's rounding). */
static inline __attribute__((always_inline)) float exp2_normal(float y) {
    /* round to nearest through a positive offset: truncation vectorises where floorf may not */
    const int32_t ni = (int32_t)(y + 128.5f) - 128;
    const float n = (float)ni;
    const float f = y - n;
    float p = 1.52527338e-5f;
    p = p * f + 1.54035304e-4f;
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    const union { int32_t i; float f; } scale = {.i = (ni + 127) << 23};
    return p * scale.f;
}

/* exp(x) for x <= 0 (scores minus their maximum); 0 below 2^-126. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    const float y = x * 1.44269504088896341f;
    const float e = exp2_normal(y < -126.0f ? -126.0f : y);
    return y < -126.0f ? 0.0f : e;
}

/* exp(x) for any x: 0 below 2^-126, clamped at 2^127 above (only SiLU's 1 + exp(-x) sees it). */
static inline __attribute__((always_inline)) float exp_any(float x) {
    const float y = x * 1.44269504088896341f;
    const float e = exp2_normal(y < -126.0f ? -126.0f : (y > 127.0f ? 127.0f : y));
    return y < -126.0f ? 0.0f : e;
}

/* silu(g) = g / (1 + exp(-g)) in fp32, as torch computes it for the gated MLP. */
static inline __attribute__((always_inline)) float silu_f32(float g) {
    return g / (1.0f + exp_any(-g));
}

#endif
