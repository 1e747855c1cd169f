/*
 * Linear layers over GGUF's legacy block-quantized weights, the formats with blocks of 32
 * values (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), read as a GGUF file stores them: out = x @ W^T
 * (+ bias), with x's rows quantized to int8 blocks on the way in, as llama.cpp does.
 * (ae_linear_quant, at the end, also hands the K-quants to quant_kquants.c.)
 *
 * Weights: W [N][K] is N rows of K / 32 blocks, row-major, nothing between rows (ggml's
 * block_q8_0 ... block_q5_1; d and m fp16, qh a little-endian uint32):
 *   Q8_0, 34 bytes: d, then 32 int8 q; weight i = q[i] * d.
 *   Q4_0, 18 bytes: d, then 16 bytes; byte j's low nibble is element j, its high nibble
 *     element j + 16; weight = (q - 8) * d.
 *   Q4_1, 20 bytes: d, m, then the nibbles as Q4_0; weight = q * d + m.
 *   Q5_0, 22 bytes: d, qh (bit j: element j's fifth bit), the nibbles; weight = (q - 16) * d.
 *   Q5_1, 24 bytes: d, m, qh, the nibbles; weight = q * d + m (q in 0..31).
 *
 * Activations: each row of x is cut into blocks of 32 and each block quantized to int8 with
 * one fp32 scale (ae_quantize_rows_q8: d = max|x| / 127, q = x * (127 / max|x|) rounded to
 * nearest even, so q is in [-127, 127]). A weight block against an activation block (a, da)
 * is then an exact integer dot product times the two scales, d * da * sum (q - offset) a; a
 * format with a minimum m (Q4_1, Q5_1) adds m * da * sum a, whose da * sum a (sa, one float
 * per activation block, as llama.cpp's block_q8_1 keeps it) is computed once per call. The
 * products of the blocks are summed in fp32 (in lanes, in block order; the scalar path in
 * block order), the bias added in fp32, one rounding to the output dtype at the store.
 *
 * Paths, chosen per call (ae_quant_set_path; the best built one unless told otherwise): every
 * one gives the same integer block dots, so they differ only in the order of the fp32 sums.
 *   AVX512-VNNI: two blocks per vpdpbusd (zmm), on activations laid out for it once per call;
 *     per-lane sums, each block's two scales applied by one FMA, one horizontal sum per output
 *     (see struct vnni_rows); the m terms, one FMA per 16 blocks into the same lane sums.
 *   AVX2: vpmaddubsw (unsigned by signed into saturating int16 pairs). Q8_0's signed weights
 *     go in as |w|, with a taking w's sign (vpsignb): each pair is at most 2 * 128 * 127,
 *     inside int16, so nothing saturates; the nibble formats' q (at most 31) go in as they
 *     are, and Q4_0's and Q5_0's offsets come out of the int32 lane sums (lane_corr: one
 *     vpaddd per block, where two vpsignb and the offset's own ops were). The m terms, one
 *     FMA per 8 blocks.
 *   Scalar: plain loops (any CPU; a build without AVX2).
 *
 * Work: items of ROWS_PER_ITEM weight rows (more where N is huge), on linear.c's pool for up
 * to AE_POOL_MAX_ROWS rows of x (a decode step: no thread waits for a preempted one), else on
 * OpenMP. Within an item, tiles of up to 4 rows of x by C weight rows (tile_cols: one, so
 * that a weight row is one stream front to back; two for the nibble formats at 2-4 rows):
 * each weight block is loaded (and unpacked) once per tile and used for all its rows of x,
 * the tile's sums in registers; the item's weights stay in L2 between its row tiles.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
/* (BW for the byte masks that set Q5's fifth bits; every CPU with VNNI has it) */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define HAVE_VNNI 1
#endif
#endif

#include "ae_kernels.h"
#include "ae_vec.h"
#include "linear.h"
#include "pool.h"
#include "quant_gemm.h"

#define QK 32          /* weights per block */
#define ROWS_PER_ITEM 16
#define MAX_R 4        /* rows of x per tile */
#define MAX_C 4        /* weight rows per tile */
/* Software prefetch this far ahead of the weight loads, into L2 (prefetcht1): prefetches into
 * L1 hold one of its few miss buffers each until the line arrives, which capped a thread's
 * stream. AMD Zen 4, 2 cores, a 1B model's one-token decode (its layers' one-row products
 * and lm_head): Q4_K_M 28.9 -> 27.0 ms a token on average of 5 alternating runs (4 faster),
 * Q8_0 (whose AVX2 tile had no prefetch) 37.2-45.6 -> 33.6-44.5 ms (4 of 4 faster); its
 * layers' products alone, 32-35 -> 37 GB/s at 6-8 KB ahead, 34 at 4 KB. */
#define PREFETCH_BYTES 8192
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, _MM_HINT_T1)

/* Format codes as ae_kernels.h (quant_formats.FORMATS); FMT_END: the first one not here. */
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q5_0 = 3, FMT_Q5_1 = 4, FMT_END = 5 };
/* PATH_AVX2_VNNI is internal: the AVX2 tile with vpdpbusd (ymm) for its byte products, which
 * one-row Q8_0 products take on AVX512-VNNI machines (see ae_linear_quant). */
enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2, PATH_AVX2_VNNI = 3 };

/* A format's block: its bytes, which parts it has and where they lie (from the block's start;
 * d is always first), and what is subtracted from its quants. Constants in every kernel: each
 * is inlined once per format. */
static ALWAYS_INLINE int block_bytes(int fmt) {
    static const int bytes[FMT_END] = {34, 18, 20, 22, 24};
    return bytes[fmt];
}
/* an fp16 minimum m right after d */
static ALWAYS_INLINE int has_min(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_Q5_1; }
/* a uint32 of fifth bits after d (and m) */
static ALWAYS_INLINE int has_qh(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1; }
static ALWAYS_INLINE int qh_off(int fmt) { return 2 + 2 * has_min(fmt); }
/* the quants: Q8_0's 32 int8, the others' 16 bytes of nibbles */
static ALWAYS_INLINE int qs_off(int fmt) { return 2 + 2 * has_min(fmt) + 4 * has_qh(fmt); }
/* weight = (q - q_offset) * d (+ m) for the formats of unsigned quants */
static ALWAYS_INLINE int q_offset(int fmt) {
    return fmt == FMT_Q4_0 ? 8 : fmt == FMT_Q5_0 ? 16 : 0;
}

static int best_path(void) {
#if defined(HAVE_VNNI)
    return PATH_VNNI;
#elif defined(HAVE_AVX2)
    return PATH_AVX2;
#else
    return PATH_SCALAR;
#endif
}

/* The path the next calls take; -1 until set (the best). Atomic: set by tests between calls. */
static int chosen_path = -1;

static int current_path(void) {
    const int p = __atomic_load_n(&chosen_path, __ATOMIC_RELAXED);
    return p < 0 ? best_path() : p;
}

/* Bit p set for each path p this build has (1: scalar, 2: AVX2, 4: AVX512-VNNI). */
int ae_quant_paths(void) {
    int paths = 1 << PATH_SCALAR;
#ifdef HAVE_AVX2
    paths |= 1 << PATH_AVX2;
#endif
#ifdef HAVE_VNNI
    paths |= 1 << PATH_VNNI;
#endif
    return paths;
}

/* Take path `path` (0 scalar, 1 AVX2, 2 AVX512-VNNI; -1 the best built) from the next call on;
 * returns the path now in effect, or -1 (nothing changed) where this build lacks it. -2 changes
 * nothing and returns the path in effect. */
int ae_quant_set_path(int path) {
    if (path == -2) return current_path();
    if (path < -1 || (path >= 0 && (path > PATH_VNNI || !(ae_quant_paths() & (1 << path)))))
        return -1;
    __atomic_store_n(&chosen_path, path, __ATOMIC_RELAXED);
    return current_path();
}

static ALWAYS_INLINE float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* ---- activations ---- */

/* The largest |v| of n values (a multiple of 32; NaNs skipped, as fmaxf skips them). */
static ALWAYS_INLINE float abs_max(const float *v, int n) {
#ifdef HAVE_VNNI
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 m = _mm512_setzero_ps();
    /* max_ps returns its second operand where one is a NaN: m, as fmaxf returns the number */
    for (int i = 0; i < n; i += 16)
        m = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(v + i)), m);
    return _mm512_reduce_max_ps(m);
#elif defined(HAVE_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(v[i]));
    return amax;
#endif
}

/* 32 values v as int8 q = v * id clamped to [-127, 127] and rounded to nearest even. */
static ALWAYS_INLINE void quantize_32(const float *v, float id, int8_t *restrict q) {
#ifdef HAVE_VNNI
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 vid = _mm512_set1_ps(id);
    for (int h = 0; h < 2; h++) { /* the default rounding mode: to nearest even */
        const __m512 c =
            _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * h), vid), lo), hi);
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
    }
#elif defined(HAVE_AVX2)
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i r[4];
    for (int i = 0; i < 4; i++) /* round to nearest even, as nearbyintf */
        r[i] = _mm256_cvtps_epi32(_mm256_min_ps(
            _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(id)), lo), hi));
    /* the packs interleave 128-bit lanes: 4-value groups 0, 2, 4, 6, 1, 3, 5, 7 */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                              _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < QK; i++) {
        /* clamped: no undefined conversion of a NaN or infinity */
        const float c = fminf(fmaxf(v[i] * id, -127.0f), 127.0f);
        q[i] = (int8_t)nearbyintf(c);
    }
#endif
}

/* One row of K values (dtype dt) as int8 (qs) in groups of `group` values (32 or 256) with one
 * fp32 scale each, written once per block of 32 (d: K / 32 of them, `group` / 32 equal ones in
 * a row). The SIMD branches do the same operations in lanes: the same bits. */
static void quantize_row(int dt, const void *x, int64_t K, int group, int8_t *restrict qs,
                         float *restrict d) {
    float buf[256];
    for (int64_t g = 0; g < K / group; g++) {
        load_f32((const char *)x + g * group * elem_size(dt), buf, group, dt);
        const float amax = abs_max(buf, group);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float scale = amax / 127.0f;
        for (int b = 0; b < group / QK; b++) {
            d[g * (group / QK) + b] = scale;
            quantize_32(buf + b * QK, id, qs + g * group + b * QK);
        }
    }
}

/* x's M rows (row stride x_st elements) quantized row by row in groups of `group` values. */
static void quantize_rows(int dt, const void *x, int64_t x_st, int64_t M, int64_t K, int group,
                          int8_t *qs, float *d, int num_threads) {
    const int team = M < num_threads ? (int)M : num_threads;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && M >= 16)
    for (int64_t m = 0; m < M; m++)
        quantize_row(dt, (const char *)x + m * x_st * elem_size(dt), K, group, qs + m * K,
                     d + m * (K / QK));
}

/*
 * x's M rows (dtype dt, K values each, K a multiple of 32, row stride x_st elements) as int8
 * blocks: qs [M][K] and one fp32 scale per block, d [M][K / 32] (see the top). What the
 * products below compute on, for tests and references.
 */
void ae_quantize_rows_q8(int dt, const void *x, int64_t x_st, int64_t M, int64_t K, int8_t *qs,
                         float *d, int num_threads) {
    quantize_rows(dt, x, x_st, M, K, QK, qs, d, num_threads);
}

/*
 * The same with one scale per 256 values (K a multiple of 256), as llama.cpp's block_q8_K: the
 * activations of the K-quant products (quant_kquants.c, quant_gemm.c). d is still one float per
 * block of 32 (eight equal ones per 256 values), so that code reading blocks of 32 reads these.
 */
void ae_quantize_rows_q8k(int dt, const void *x, int64_t x_st, int64_t M, int64_t K, int8_t *qs,
                          float *d, int num_threads) {
    quantize_rows(dt, x, x_st, M, K, 256, qs, d, num_threads);
}

/*
 * sa[m * st + b] = da * (the sum of block b's int8 values) for x's M quantized rows (qa, da)
 * of nb blocks, zeros from nb up to st: the factor of the m terms (see the top).
 */
static void block_sums(const int8_t *qa, const float *da, int64_t M, int64_t nb, int64_t st,
                       float *sa) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *q = qa + (m * nb + b) * QK;
            int32_t s = 0;
            for (int i = 0; i < QK; i++) s += q[i];
            sa[m * st + b] = da[m * nb + b] * (float)s;
        }
        for (int64_t b = nb; b < st; b++) sa[m * st + b] = 0.0f;
    }
}

/*
 * corr[b * 8 + l] = -offset * (the sum of bytes 4l .. 4l + 3 of block b) for the n blocks of
 * 32 int8 at qa: what a tile adds to each block's 4-byte lane sums of q * a where the weights
 * go in unsigned (q + offset on VNNI, Q4_0's and Q5_0's q on AVX2), so that the block's dot
 * stays the exact sum of the true weights times a.
 */
static void lane_corr(const int8_t *qa, int64_t n, int offset, int32_t *corr) {
    for (int64_t l = 0; l < n * 8; l++) {
        const int8_t *q = qa + 4 * l;
        corr[l] = -offset * (q[0] + q[1] + q[2] + q[3]);
    }
}

/* ---- one tile: R rows of x against C weight rows ---- */

#ifdef HAVE_AVX2
/* A block's 16 bytes of nibbles (at qs) as 32 bytes 0..15, in element order. */
static ALWAYS_INLINE __m256i load_nibbles(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    return _mm256_set_m128i(hi, lo);
}

/* A block's qh (at p) as 32 bytes: 0xFF in byte j where bit j is set, else 0. */
static ALWAYS_INLINE __m256i fifth_bits(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    /* byte j gets qh's byte j / 8 (the shuffle is per 128-bit lane: both lanes hold qh) */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                         3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL); /* j % 8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* A weight block's 32 values as bytes, in element order: Q8_0's signed q; the others' q as it
 * is (unsigned, 0..15 or 0..31: Q4_0's and Q5_0's offset is taken out through corr, below). */
static ALWAYS_INLINE __m256i load_w(int fmt, const uint8_t *blk) {
    if (fmt == FMT_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m256i q = load_nibbles(blk + qs_off(fmt));
    if (!has_qh(fmt)) return q;
    const __m256i high = fifth_bits(blk + qh_off(fmt));
    return _mm256_or_si256(q, _mm256_and_si256(high, _mm256_set1_epi8(16)));
}

static ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* One weight block's values as int8 (wq: q - q_offset; Q4_1's and Q5_1's q as they are) and
 * its scale d. */
static ALWAYS_INLINE float unpack_block(int fmt, const uint8_t *blk, int8_t *restrict wq) {
    if (fmt == FMT_Q8_0) {
        memcpy(wq, blk + 2, QK);
    } else {
        const uint8_t *qs = blk + qs_off(fmt);
        uint32_t qh = 0;
        if (has_qh(fmt)) memcpy(&qh, blk + qh_off(fmt), 4);
        for (int j = 0; j < QK / 2; j++) {
            const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
            const int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
            wq[j] = (int8_t)(lo - q_offset(fmt));
            wq[j + QK / 2] = (int8_t)(hi - q_offset(fmt));
        }
    }
    return f16_at(blk);
}

#ifdef HAVE_AVX2
/* Block b of the AVX2 tile (below) into the sums acc; corr: Q4_0's and Q5_0's offsets (the
 * rows' lane_corr). */
static ALWAYS_INLINE void avx2_block(const int fmt, const int path, const int R, const int C,
                                     const uint8_t *w,
                                     int64_t row_bytes, int64_t b, const int8_t *qa,
                                     const float *da, const int32_t *corr, int64_t nb, int64_t K,
                                     __m256 acc[MAX_R][MAX_C]) {
    const int is_unsigned = fmt != FMT_Q8_0;
    const int64_t bb = block_bytes(fmt);
    __m256i wv[MAX_C], wx[MAX_C];
    __m256 dw[MAX_C];
    for (int c = 0; c < C; c++) {
        const uint8_t *blk = w + c * row_bytes + b * bb;
        PREFETCH(blk);
        dw[c] = _mm256_set1_ps(f16_at(blk));
        wv[c] = load_w(fmt, blk);
        /* |w|; |-128| reads as 128 unsigned */
        wx[c] = is_unsigned ? wv[c] : _mm256_sign_epi8(wv[c], wv[c]);
    }
    for (int r = 0; r < R; r++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + r * K + b * QK));
        const __m256 d = _mm256_set1_ps(da[r * nb + b]);
        for (int c = 0; c < C; c++) {
            const __m256i as = is_unsigned ? a : _mm256_sign_epi8(a, wv[c]);
            __m256i s;
#ifdef HAVE_VNNI
            if (path == PATH_AVX2_VNNI) /* one vpdpbusd for vpmaddubsw and vpmaddwd */
                s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wx[c], as);
            else
#endif
                s = _mm256_madd_epi16(_mm256_maddubs_epi16(wx[c], as), _mm256_set1_epi16(1));
            if (q_offset(fmt))
                s = _mm256_add_epi32(
                    s, _mm256_loadu_si256((const __m256i *)(corr + (r * nb + b) * 8)));
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[c], d),
                                        acc[r][c]);
        }
    }
}
#endif

/*
 * res[r * res_st + c] = the product of x row r (qa + r * K, scales da + r * nb, block sums
 * sa + r * sa_st; AVX2, Q4_0 and Q5_0: offset terms corr + r * nb * 8) with weight row c
 * (w + c * row_bytes), for r < R, c < C; nb blocks. R, C, fmt and path are constants in each
 * inlined copy.
 */
static ALWAYS_INLINE void tile(const int fmt, const int path, const int R, const int C,
                               const uint8_t *w, int64_t row_bytes, int64_t nb,
                               const int8_t *qa, const float *da, const float *sa,
                               int64_t sa_st, const int32_t *corr, int64_t K, float *res,
                               int64_t res_st) {
    const int64_t bb = block_bytes(fmt);
#ifdef HAVE_AVX2
    if (path != PATH_SCALAR) {
        __m256 acc[MAX_R][MAX_C], acc2[MAX_R][MAX_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = acc2[r][c] = _mm256_setzero_ps();
        int64_t b = 0;
        /* A tile of one or two sums alternates two sets of them between blocks: one set's
         * chain of FMAs (4 cycles each) bound the loop (a 1 x 1 tile ran 12 cycles a block
         * on AMD Zen 4). Larger tiles have chains enough, and no registers to spare. */
        if (R * C <= 2) {
            for (; b + 1 < nb; b += 2) {
                avx2_block(fmt, path, R, C, w, row_bytes, b, qa, da, corr, nb, K, acc);
                avx2_block(fmt, path, R, C, w, row_bytes, b + 1, qa, da, corr, nb, K, acc2);
            }
        }
        for (; b < nb; b++)
            avx2_block(fmt, path, R, C, w, row_bytes, b, qa, da, corr, nb, K, acc);
        if (R * C <= 2)
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_add_ps(acc[r][c], acc2[r][c]);
        /* m * sa, 8 blocks at a time into the same lanes (sa is zero past the row's end) */
        for (int64_t g = 0; has_min(fmt) && g < nb; g += 8) {
            __m256 mw[MAX_C];
            for (int c = 0; c < C; c++) {
                uint16_t h[8];
                for (int i = 0; i < 8; i++) {
                    h[i] = 0;
                    if (g + i < nb) memcpy(&h[i], w + c * row_bytes + (g + i) * bb + 2, 2);
                }
                mw[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            }
            for (int r = 0; r < R; r++) {
                const __m256 s = _mm256_loadu_ps(sa + r * sa_st + g);
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(mw[c], s, acc[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) res[r * res_st + c] = hsum8(acc[r][c]);
        return;
    }
#endif
    (void)path, (void)corr;
    float acc[MAX_R][MAX_C] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        int8_t wq[MAX_C][QK];
        float dw[MAX_C], mw[MAX_C];
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + b * bb;
            dw[c] = unpack_block(fmt, blk, wq[c]);
            mw[c] = has_min(fmt) ? f16_at(blk + 2) : 0.0f;
        }
        for (int r = 0; r < R; r++) {
            const int8_t *a = qa + r * K + b * QK;
            const float d = da[r * nb + b];
            for (int c = 0; c < C; c++) {
                int32_t s = 0;
                for (int i = 0; i < QK; i++) s += (int32_t)wq[c][i] * a[i];
                acc[r][c] += (float)s * (dw[c] * d);
                if (has_min(fmt)) acc[r][c] += mw[c] * sa[r * sa_st + b];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) res[r * res_st + c] = acc[r][c];
}

/*
 * The AVX512-VNNI tile works on activations laid out for it once per call (struct vnni_rows),
 * so that its inner loop is, per two weight blocks and row of x: one vpdpbusd (zmm) on the two
 * blocks' bytes, a conversion, one permute of the blocks' scales and one FMA into per-lane sums
 * reduced at the row's end, with no broadcasts or horizontal sums. Each 16 blocks' fp16 weight
 * scales come in with 16 scalar loads and one vcvtph2ps; times the 16 activation scales, they
 * make a small table that a permute spreads over the two blocks' lanes. The m terms of Q4_1
 * and Q5_1 take 16 more loads, a vcvtph2ps and one FMA by the 16 blocks' sa per 16 blocks.
 *
 * vpdpbusd multiplies unsigned by signed bytes: the weights go in unsigned (Q8_0: w + 128, an
 * xor; the others: q, that is w + q_offset), and the excess, 128 (Q4_0: 8; Q5_0: 16; Q4_1 and
 * Q5_1: none) times the sum of the lane's 4 activations, starts each lane's sum negated (corr):
 * the integer dots stay exact. A nibble block's 16 bytes hold elements 0-15 (low nibbles) and
 * 16-31 (high): Q4_0's and Q4_1's pair of blocks unpacks as [lo 0, lo 1, hi 0, hi 1] (16 bytes
 * each), and the activations are stored in that order. Q5_0's and Q5_1's unpacks, with one
 * more shuffle, in element order (block b, then b + 1; the activations as Q8_0's), so that the
 * two qh side by side (h1 << 32 | h0) are a byte mask in the bytes' order: the fifth bits are
 * added as 16 under it (in the other order, the mask took ~15 scalar instructions per pair and
 * weight row). Blocks past the row's end (to a multiple of 16) are zeros in a, corr, da and
 * sa.
 */
struct vnni_rows {
    const int8_t *a;     /* [M][nbp * 32] the blocks' bytes, in pairs as above */
    const int32_t *corr; /* [M][nbp * 8] each lane's -excess * sum of its 4 bytes */
    const float *da;     /* [M][nbp] the blocks' scales */
    int64_t nbp;         /* blocks per row, rounded up to 16 */
};

static ALWAYS_INLINE int64_t round16(int64_t nb) { return (nb + 15) & ~(int64_t)15; }

#ifdef HAVE_VNNI
/* What vpdpbusd's unsigned weights exceed the true ones by (see above). */
static ALWAYS_INLINE int vnni_excess(int fmt) { return fmt == FMT_Q8_0 ? 128 : q_offset(fmt); }

/* A pair of blocks in element order (Q8_0, Q5_0, Q5_1), else as [lo 0, lo 1, hi 0, hi 1]. */
static ALWAYS_INLINE int in_order(int fmt) { return fmt == FMT_Q8_0 || has_qh(fmt); }

/* Bytes of the prepared activations of M rows of nb blocks. */
static size_t vnni_bytes(int64_t M, int64_t nb) {
    return (size_t)(M * round16(nb)) * (32 + 32 + 4);
}

/* x's quantized rows (qa [M][K], da [M][nb]) as struct vnni_rows for format fmt, in buf
 * (vnni_bytes, 64-byte aligned). */
static struct vnni_rows prepare_vnni(int fmt, const int8_t *qa, const float *da, int64_t M,
                                     int64_t nb, char *buf) {
    const int64_t nbp = round16(nb);
    int32_t *corr = (int32_t *)buf;
    int8_t *a = (int8_t *)(corr + M * nbp * 8);
    float *d = (float *)(a + M * nbp * 32);
    memset(buf, 0, vnni_bytes(M, nb));
    const int32_t excess = vnni_excess(fmt);
    for (int64_t m = 0; m < M; m++) {
        const int8_t *src = qa + m * nb * QK;
        int8_t *dst = a + m * nbp * QK;
        for (int64_t b = 0; b < nb; b++) {
            d[m * nbp + b] = da[m * nb + b];
            if (in_order(fmt)) {
                memcpy(dst + b * QK, src + b * QK, QK);
            } else { /* pair (2i, 2i+1): [2i lo, 2i+1 lo, 2i hi, 2i+1 hi], 16 bytes each */
                int8_t *pair = dst + (b & ~(int64_t)1) * QK + (b & 1) * 16;
                memcpy(pair, src + b * QK, 16);
                memcpy(pair + 32, src + b * QK + 16, 16);
            }
        }
        if (excess) lane_corr(dst, nbp, excess, corr + m * nbp * 8);
    }
    return (struct vnni_rows){a, corr, d, nbp};
}

/* Blocks b and b + 1 of a weight row (blk: block b) as the unsigned bytes vpdpbusd takes,
 * lined up with the activations; only block b where `half` (block b + 1 lies past the row). */
static ALWAYS_INLINE __m512i load_pair(const int fmt, const int half, const uint8_t *blk) {
    const int bb = block_bytes(fmt);
    if (fmt == FMT_Q8_0) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m512i w =
            half ? _mm512_zextsi256_si512(lo)
                 : _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                                      _mm256_loadu_si256((const __m256i *)(blk + 2 + bb)), 1);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    const uint8_t *qs = blk + qs_off(fmt);
    const __m128i b0 = _mm_loadu_si128((const __m128i *)qs);
    const __m256i q = half ? _mm256_zextsi128_si256(b0)
                           : _mm256_inserti128_si256(_mm256_castsi128_si256(b0),
                                                     _mm_loadu_si128((const __m128i *)(qs + bb)),
                                                     1);
    /* [lo 0, lo 1, hi 0, hi 1] */
    __m512i both = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi32(q, 4), 1),
        _mm512_set1_epi8(15));
    if (!has_qh(fmt)) return both;
    both = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)); /* [lo 0, hi 0, lo 1, hi 1] */
    uint32_t h0, h1 = 0;
    memcpy(&h0, blk + qh_off(fmt), 4);
    if (!half) memcpy(&h1, blk + bb + qh_off(fmt), 4);
    return _mm512_mask_add_epi8(both, (uint64_t)h1 << 32 | h0, both, _mm512_set1_epi8(16));
}

/* Which of a group's 16 scales each lane of pair p takes (in element order: 8 lanes per block;
 * else 4, 4, then 4 and 4 again). */
static ALWAYS_INLINE __m512i pair_lanes(const int fmt, int p) {
    const __m512i first = in_order(fmt) ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1,
                                                            1, 1, 1, 1)
                                        : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0,
                                                            1, 1, 1, 1);
    return _mm512_add_epi32(first, _mm512_set1_epi32(2 * p)); /* a constant where p is */
}

/* 16 fp16 values at p, p + stride, ... (the first n where not `full`; zeros after) as fp32.
 * 16 scalar loads: a gather takes longer on AMD Zen 4. */
static ALWAYS_INLINE __m512 load16_f16(const uint8_t *p, int stride, const int full, int n) {
    uint16_t h[16] __attribute__((aligned(32)));
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        uint16_t v = 0;
        if (full || i < n) memcpy(&v, p + i * stride, 2);
        h[i] = v;
    }
    return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)h));
}

/* Pair p of the group at block g (blocks g + 2p and g + 2p + 1; `half`: the first only) into
 * the tile's sums, with the group's scales. */
static ALWAYS_INLINE void vnni_pair(const int fmt, const int R, const int C, const int half,
                                    const uint8_t *w, int64_t row_bytes, int64_t g, int p,
                                    const struct vnni_rows *x, __m512 scale[MAX_R][MAX_C],
                                    __m512 acc[MAX_R][MAX_C]) {
    const int bb = block_bytes(fmt);
    const int64_t b = g + 2 * p;
    const __m512i lanes = pair_lanes(fmt, p);
    __m512i wv[MAX_C];
    for (int c = 0; c < C; c++) {
        const uint8_t *blk = w + c * row_bytes + b * bb;
        PREFETCH(blk);
        wv[c] = load_pair(fmt, half, blk);
    }
    for (int r = 0; r < R; r++) {
        const __m512i a = _mm512_loadu_si512(x->a + r * x->nbp * QK + b * QK);
        const __m512i corr = vnni_excess(fmt)
                                 ? _mm512_loadu_si512(x->corr + r * x->nbp * 8 + b * 8)
                                 : _mm512_setzero_si512();
        for (int c = 0; c < C; c++) {
            const __m512i s = _mm512_dpbusd_epi32(corr, wv[c], a);
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                        _mm512_permutexvar_ps(lanes, scale[r][c]), acc[r][c]);
        }
    }
}

/* One group of up to 16 blocks (g: the first; n: how many) of the tile's sums. */
static ALWAYS_INLINE void vnni_group(const int fmt, const int R, const int C, const int full,
                                     const uint8_t *w, int64_t row_bytes, int64_t g, int n,
                                     const struct vnni_rows *x, const float *sa,
                                     int64_t sa_st, __m512 acc[MAX_R][MAX_C]) {
    const int bb = block_bytes(fmt);
    __m512 scale[MAX_R][MAX_C]; /* dw * da of the group's 16 blocks */
    for (int c = 0; c < C; c++) {
        const uint8_t *blk = w + c * row_bytes + g * bb;
        const __m512 dw = load16_f16(blk, bb, full, n);
        for (int r = 0; r < R; r++)
            scale[r][c] = _mm512_mul_ps(dw, _mm512_loadu_ps(x->da + r * x->nbp + g));
        if (has_min(fmt)) { /* m * sa of the 16 blocks, into the lanes */
            const __m512 mw = load16_f16(blk + 2, bb, full, n);
            for (int r = 0; r < R; r++)
                acc[r][c] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sa + r * sa_st + g), acc[r][c]);
        }
    }
    if (!full) { /* the row's last blocks, once per row: not unrolled (build time) */
#pragma GCC unroll 1
        for (int p = 0; p < (n + 1) / 2; p++)
            vnni_pair(fmt, R, C, 2 * p + 1 == n, w, row_bytes, g, p, x, scale, acc);
    } else if (has_qh(fmt)) { /* unrolled by 8, Q5_0's loop ran ~25% slower at one row (Zen 4) */
#pragma GCC unroll 2
        for (int p = 0; p < 8; p++) vnni_pair(fmt, R, C, 0, w, row_bytes, g, p, x, scale, acc);
    } else {
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) vnni_pair(fmt, R, C, 0, w, row_bytes, g, p, x, scale, acc);
    }
}

/* tile() on AVX512-VNNI over the prepared rows x (R of them). */
static ALWAYS_INLINE void tile_vnni(const int fmt, const int R, const int C, const uint8_t *w,
                                    int64_t row_bytes, int64_t nb, const struct vnni_rows *x,
                                    const float *sa, int64_t sa_st, float *res, int64_t res_st) {
    __m512 acc[MAX_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= nb; g += 16)
        vnni_group(fmt, R, C, 1, w, row_bytes, g, 16, x, sa, sa_st, acc);
    if (g < nb) vnni_group(fmt, R, C, 0, w, row_bytes, g, (int)(nb - g), x, sa, sa_st, acc);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) res[r * res_st + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

/* tile() with R and C as constants: one inlined copy per (fmt, path, R, C) that tile_cols
 * makes (R x 2 for the nibble formats at 2-4 rows of x, else R x 1). The scalar
 * path, a fallback, has one copy per format, R and C as variables: the copies cost build
 * time (the file takes the longest to compile of all). */
#ifdef HAVE_VNNI
#define TILE_VNNI(fmt, path, R, C)                                                         \
    if (path == PATH_VNNI) {                                                               \
        tile_vnni(fmt, R, C, w, row_bytes, nb, xv, sa, sa_st, res, res_st);                \
        return;                                                                            \
    }
#else
#define TILE_VNNI(fmt, path, R, C)
#endif
#define TILE_CASE(fmt, path, R, C)                                                         \
    case (R) * 8 + (C):                                                                    \
        TILE_VNNI(fmt, path, R, C)                                                         \
        tile(fmt, path, R, C, w, row_bytes, nb, qa, da, sa, sa_st, corr, K, res, res_st);  \
        return;
#define TILE_RS(fmt, path, C) \
    TILE_CASE(fmt, path, 1, C) TILE_CASE(fmt, path, 2, C) TILE_CASE(fmt, path, 3, C) \
    TILE_CASE(fmt, path, 4, C)

static ALWAYS_INLINE void tile_rc(const int fmt, const int path, int R, int C, const uint8_t *w,
                                  int64_t row_bytes, int64_t nb, const int8_t *qa,
                                  const float *da, const float *sa, int64_t sa_st,
                                  const int32_t *corr, const struct vnni_rows *xv, int64_t K,
                                  float *res, int64_t res_st) {
    (void)xv;
    if (path == PATH_SCALAR) {
        tile(fmt, PATH_SCALAR, R, C, w, row_bytes, nb, qa, da, sa, sa_st, corr, K, res, res_st);
        return;
    }
    switch (R * 8 + C) {
        TILE_RS(fmt, path, 2)
        TILE_RS(fmt, path, 1)
        default: abort();
    }
}

/* Weight rows per tile: one for Q8_0, and for the others at one row of x; else two (AVX2 has
 * 16 registers: 4 x 4 sums and the weights would spill). Measured on AMD Zen 4 (2 cores): one
 * weight row per tile reads one stream front to back, which the hardware prefetchers follow;
 * four rows of 34-byte blocks side by side ran one-row products 1.5-2x slower (SmolLM2 Q8_0
 * decoded 88 tok/s against 145), two 1.3x slower at 2 rows; for the nibble formats at 2-8
 * rows, 4 x 2 tiles stay 0-10% ahead. */
static ALWAYS_INLINE int tile_cols(int fmt, int path, int64_t M) {
    if (path == PATH_SCALAR) return 4; /* the portable fallback, as it always ran */
    return M > 1 && fmt != FMT_Q8_0 ? 2 : 1;
}

/* ---- the product, item by item ---- */

struct quant_job {
    const uint8_t *w;
    const int8_t *qa;
    const float *da;
    const float *sa;     /* Q4_1 and Q5_1: the block sums (block_sums), rows of sa_st */
    const int32_t *corr; /* AVX2, Q4_0 and Q5_0: the offsets' terms (lane_corr) */
    struct vnni_rows xv; /* the VNNI path's layout of qa and da */
    const void *bias;
    void *out;
    int64_t M, N, K, o_st, per_item, sa_st;
    int fmt, path, dt;
};

static ALWAYS_INLINE void item_rows(const struct quant_job *j, const int fmt, const int path,
                                    int64_t n0, int64_t n1, float *res) {
    const int64_t nb = j->K / QK, row_bytes = nb * block_bytes(fmt), cols = n1 - n0;
    const int cmax = tile_cols(fmt, path, j->M);
    for (int64_t m = 0; m < j->M; m += MAX_R) {
        const int R = j->M - m < MAX_R ? (int)(j->M - m) : MAX_R;
        const int8_t *qa = j->qa + m * j->K;
        const float *da = j->da + m * nb;
        const float *sa = j->sa ? j->sa + m * j->sa_st : NULL;
        const int32_t *corr = j->corr ? j->corr + m * nb * 8 : NULL;
        const int64_t nbp = j->xv.nbp;
        const struct vnni_rows xv = {j->xv.a + m * nbp * QK, j->xv.corr + m * nbp * 8,
                                     j->xv.da + m * nbp, nbp};
        int64_t n = n0;
        for (; n + cmax <= n1; n += cmax)
            tile_rc(fmt, path, R, cmax, j->w + n * row_bytes, row_bytes, nb, qa, da, sa, j->sa_st,
                    corr, &xv,
                    j->K,
                    res + m * cols + n - n0, cols);
        for (; n < n1; n++) /* the item's last rows, one at a time */
            tile_rc(fmt, path, R, 1, j->w + n * row_bytes, row_bytes, nb, qa, da, sa, j->sa_st,
                    corr, &xv,
                    j->K,
                    res + m * cols + n - n0, cols);
    }
}

/* item_rows() for each format and path as a function of its own: inlined all into quant_item,
 * GCC took minutes to compile the one huge function (over 10 under the sanitizers). */
#define ITEM_ROWS_FN(fmt, path)                                                             \
    static __attribute__((noinline)) void item_rows_##fmt##_##path(                          \
        const struct quant_job *j, int64_t n0, int64_t n1, float *res) {                      \
        item_rows(j, fmt, path, n0, n1, res);                                               \
    }
#define ITEM_ROWS_FNS(fmt) \
    ITEM_ROWS_FN(fmt, PATH_SCALAR) ITEM_ROWS_FN(fmt, PATH_AVX2) ITEM_ROWS_FN(fmt, PATH_VNNI)
ITEM_ROWS_FNS(FMT_Q8_0)
#ifdef HAVE_VNNI
ITEM_ROWS_FN(FMT_Q8_0, PATH_AVX2_VNNI)
#endif
ITEM_ROWS_FNS(FMT_Q4_0)
ITEM_ROWS_FNS(FMT_Q4_1)
ITEM_ROWS_FNS(FMT_Q5_0)
ITEM_ROWS_FNS(FMT_Q5_1)
#define ITEM_ROWS_CASE(fmt)                                                                  \
    case fmt:                                                                                \
        if (j->path == PATH_VNNI) item_rows_##fmt##_PATH_VNNI(j, n0, n1, res);               \
        else if (j->path == PATH_AVX2) item_rows_##fmt##_PATH_AVX2(j, n0, n1, res);          \
        else item_rows_##fmt##_PATH_SCALAR(j, n0, n1, res);                                  \
        break;

static void quant_item(const void *ctx, int64_t item, const struct ae_commit *commit) {
    const struct quant_job *j = ctx;
    const int64_t n0 = item * j->per_item;
    const int64_t n1 = n0 + j->per_item < j->N ? n0 + j->per_item : j->N, cols = n1 - n0;
    float *res = ae_thread_scratch((size_t)(j->M * cols + cols));
#ifdef HAVE_VNNI
    if (j->path == PATH_AVX2_VNNI) item_rows_FMT_Q8_0_PATH_AVX2_VNNI(j, n0, n1, res);
    else
#endif
    switch (j->fmt) {
        ITEM_ROWS_CASE(FMT_Q8_0)
        ITEM_ROWS_CASE(FMT_Q4_0)
        ITEM_ROWS_CASE(FMT_Q4_1)
        ITEM_ROWS_CASE(FMT_Q5_0)
        ITEM_ROWS_CASE(FMT_Q5_1)
        default: abort();
    }
    ae_commit_rows(commit, res, j->M, cols, j->bias, j->dt, j->out, j->o_st, n0);
}

static int linear_quant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                        int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                        int num_threads) {
    if (K % QK != 0 || K <= 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t nb = K / QK;
    /* the rows as int8 blocks where the item's threads read them: the pool's buffer when the
     * caller holds the pool (a late helper may read it after this call), else fresh memory */
    int path = current_path();
    /* Q8_0 at one row: AVX2's tile, a block at a time with its scale broadcast, read 1.1-1.75x
     * faster than the VNNI tile's pairs of blocks on SmolLM2's and Llama-3.2-1B's shapes (AMD
     * Zen 4, one thread); from two rows on the VNNI tile is level or ahead (up to 1.6x). Its
     * byte products as one ymm vpdpbusd each: 1.12x faster again (2048 x 2048). */
    if (path == PATH_VNNI && fmt == FMT_Q8_0 && M == 1) path = PATH_AVX2_VNNI;
    const size_t q_bytes = (size_t)(M * K), d_bytes = (size_t)(M * nb) * sizeof(float);
    /* and, for Q4_1 and Q5_1, the block sums in rows padded to 16 blocks */
    const int64_t sa_st = round16(nb);
    const size_t s_bytes = has_min(fmt) ? (size_t)(M * sa_st) * sizeof(float) : 0;
    /* and, on AVX2 for Q4_0 and Q5_0, the offsets' terms */
    const int with_corr = path == PATH_AVX2 && q_offset(fmt);
    const size_t c_bytes = with_corr ? (size_t)(M * nb * 8) * sizeof(int32_t) : 0;
    size_t bytes = q_bytes + d_bytes + s_bytes + c_bytes, v_off = 0;
#ifdef HAVE_VNNI
    if (path == PATH_VNNI) { /* and the VNNI path's layout after them, 64-byte aligned */
        v_off = (bytes + 63) & ~(size_t)63;
        bytes = v_off + vnni_bytes(M, nb) + 64;
    }
#endif
    const int pooled = ae_linear_use_pool(M, num_threads);
    char *buf = pooled ? ae_pool_buffer(0, bytes) : malloc(bytes);
    if (buf == NULL) {
        if (pooled) ae_pool_release();
        return -1;
    }
    int8_t *qa = (int8_t *)buf;
    float *da = (float *)(buf + q_bytes); /* M * K is a multiple of 32: aligned for floats */
    ae_quantize_rows_q8(dt, x, x_st, M, K, qa, da, pooled ? 1 : num_threads);
    float *sa = NULL;
    if (has_min(fmt)) {
        sa = (float *)(buf + q_bytes + d_bytes);
        block_sums(qa, da, M, nb, sa_st, sa);
    }
    int32_t *corr = NULL;
    if (with_corr) {
        corr = (int32_t *)(buf + q_bytes + d_bytes + s_bytes);
        lane_corr(qa, M * nb, q_offset(fmt), corr);
    }
    int64_t per_item = ROWS_PER_ITEM;
    while ((N + per_item - 1) / per_item > AE_POOL_MAX_ITEMS) per_item += ROWS_PER_ITEM;
    struct vnni_rows xv = {0};
#ifdef HAVE_VNNI
    if (path == PATH_VNNI) {
        char *v = buf + v_off;
        v += (64 - (uintptr_t)v % 64) % 64;
        xv = prepare_vnni(fmt, qa, da, M, nb, v);
    }
#endif
    (void)v_off;
    const struct quant_job job = {w, qa,   da,       sa,    corr, xv,   bias, out, M,
                                  N, K,    o_st,     per_item, sa_st, fmt, path, dt};
    ae_linear_run_items(pooled, quant_item, &job, sizeof job, (N + per_item - 1) / per_item,
                        num_threads);
    if (pooled) ae_pool_release();
    else free(buf);
    return 0;
}

/* From how many rows of x products of format fmt run on the panel GEMM of the path
 * (quant_gemm.c, quant_gemm_avx2.c; 0: never), on the work pool up to AE_POOL_MAX_ROWS as
 * the tiles here. On the VNNI path, where it measured faster than the tiles (2 Zen 4 cores,
 * tiles against GEMM alternating in one process, weights from memory). The 8-row layouts of
 * 32-value blocks and the legacy formats, on SmolLM2's and Qwen2.5-0.5B's projections and
 * lm_heads: Q5_0_R8 1.02-1.17x the GEMM's time at 6 rows, Q8_0_R8 and Q4_0_R8 0.75-1.15x
 * (the tiles 0.67-0.95x up to 5). Q4_K_R8 and Q6_K_R8, whose tiles prefetch (r8_prefetch),
 * on Llama-3.2-1B's projections: 0.72-0.96x and 0.89-1.05x at 6 and 8 rows. The K-quants'
 * file layouts (Q5_K; Q4_K and Q6_K where they could not be interleaved) unpack a row at a
 * time: 1.08-1.35x slower than the tiles at 8 rows, level at 9, 0.79-0.83x at 16. */
int ae_quant_gemm_min_rows(int fmt) {
    const int path = current_path();
    (void)fmt, (void)path;
#ifdef HAVE_VNNI
    if (path == PATH_VNNI) /* the K-quants (super-blocks of 256 values), interleaved or not: 9 */
        return fmt >= 0 && fmt < AE_QUANT_FORMATS && GEMM_FMT[fmt].values == 256 ? 9 : 6;
#endif
#ifdef HAVE_GEMM_AVX2
    /* AVX2's (quant_gemm_avx2.c) against the AVX2 tiles, Llama-3.2-1B's 8192 x 2048 and
     * 2048 x 8192, the weights from memory, 2 threads of an AVX2-only Zen 1 (256-bit integer
     * multiplies at half Zen 4's rate): level at 2-4 rows for the 4- and 5-bit legacy
     * formats (Q4_0, Q5_0 1.16-1.25x faster on the GEMM at 4), 10-12 for Q8_0 (tiles
     * 0.92-0.97x the GEMM's time at 6-8 rows), 6 for Q4_K and 7-8 for Q6_K (tiles
     * 0.96-1.00x at 6, 1.04-1.10x slower at 8). The 8-row layouts are the VNNI path's only. */
    static const int avx2_rows[AE_QUANT_Q4_K_R8] = {10, 4, 4, 4, 4, 7, 7, 8};
    if (path == PATH_AVX2 && fmt == AE_QUANT_Q5_0_BYTES) /* the GEMM reads it as Q5_0 */
        return avx2_rows[FMT_Q5_0];
    if (path == PATH_AVX2 && fmt >= 0 && fmt < AE_QUANT_Q4_K_R8) return avx2_rows[fmt];
#endif
    return 0;
}

/* Bit f set for each format code f (quant_formats.FORMATS) that ae_linear_quant runs: this
 * file's legacy formats and quant_kquants.c's. */
int ae_quant_formats(void) {
    return (1 << FMT_Q8_0) | (1 << FMT_Q4_0) | (1 << FMT_Q4_1) | (1 << FMT_Q5_0) |
           (1 << FMT_Q5_1) | ae_kquant_formats() | (1 << AE_QUANT_Q4_K_R8) |
           (1 << AE_QUANT_Q8_0_R8) | (1 << AE_QUANT_Q5_0_R8) | (1 << AE_QUANT_Q4_0_R8) |
           (1 << AE_QUANT_Q6_K_R8) | (1 << AE_QUANT_Q5_0_BYTES);
}

/*
 * out[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) for m < M, n < N, with W in the blocks of
 * format fmt (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1: this file, as described at the top;
 * 5 Q4_K, 6 Q5_K, 7 Q6_K: quant_kquants.c; 8 Q4_K_R8, 9 Q8_0_R8, 10 Q5_0_R8, 11 Q4_0_R8,
 * 12 Q6_K_R8: quant_r8.c; 13 Q5_0_BYTES: Q8_0's tiles, Q5_0's GEMM) and x's rows quantized to
 * int8 blocks of 32 first.
 * dt: the dtype of x, bias and out (fp32, bf16 or fp16); x [M][K] with row stride x_st; w:
 * N rows of whole blocks; bias: N values or NULL; out [M][N] with row stride o_st.
 * Returns 0; -1 when out of memory; -2 when K is not a positive multiple of the block's
 * values; -3 for a format this build does not run (ae_quant_formats).
 */
int ae_linear_quant(int fmt, int dt, const void *x, int64_t x_st, int64_t M, const void *w,
                    int64_t N, int64_t K, const void *bias, void *out, int64_t o_st,
                    int num_threads) {
    const int gemm_rows = ae_quant_gemm_min_rows(fmt);
    if (gemm_rows > 0 && M >= gemm_rows) {
        const int r = ae_quant_gemm(fmt, dt, x, x_st, M, w, N, K, bias, out, o_st, num_threads);
        if (r != -3) return r;
    }
    if (AE_QUANT_IS_R8(fmt))
        return ae_linear_r8(fmt, dt, x, x_st, M, w, N, K, bias, out, o_st, num_threads);
    /* Q5_0_BYTES: Q8_0's blocks (values in -16 .. 15), on Q8_0's tiles */
    if (fmt == AE_QUANT_Q5_0_BYTES) fmt = FMT_Q8_0;
    if (fmt >= AE_QUANT_Q4_K)
        return ae_linear_kquant(fmt, dt, x, x_st, M, w, N, K, bias, out, o_st, num_threads);
    if (fmt < 0 || fmt >= FMT_END) return -3;
    return linear_quant(fmt, dt, x, x_st, M, w, N, K, bias, out, o_st, num_threads);
}
