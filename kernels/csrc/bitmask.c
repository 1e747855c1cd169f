/*
 * Structured outputs: a grammar's token bitmask applied to rows of logits (ae_apply_bitmask).
 */

#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "ae_kernels.h"

/* -inf in each dtype's bits */
static const uint32_t NEG_INF_F32 = 0xff800000u;
static const uint16_t NEG_INF_16[3] = {0, 0xff80u, 0xfc00u}; /* index: AE_BF16, AE_F16 */

/* Set element j of the row at p (dtype dt) to -inf. */
static inline void set_neg_inf(char *p, int64_t j, int dt) {
    if (dt == AE_F32) {
        memcpy(p + 4 * j, &NEG_INF_F32, 4);
    } else {
        memcpy(p + 2 * j, &NEG_INF_16[dt], 2);
    }
}

/*
 * For each of the n_rows rows named by rows[] (indices into x, whose rows are x_st elements
 * apart), set to -inf every logit j < n whose bit is clear in that row's bitmask (int32 words
 * mask + i * mask_st; bit j % 32 of word j / 32). Words of all ones (a free-text state) are
 * skipped and words of all zeros (a structural state) are filled at once, so the cost follows
 * what the grammar forbids. Rows run in parallel.
 */
void ae_apply_bitmask(int dt, void *x, int64_t x_st, const int64_t *rows, int64_t n_rows,
                      const int32_t *mask, int64_t mask_st, int64_t n, int num_threads) {
    const int64_t es = dt == AE_F32 ? 4 : 2;
    const int64_t words = (n + 31) / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n_rows > 1)
    for (int64_t i = 0; i < n_rows; i++) {
        char *p = (char *)x + rows[i] * x_st * es;
        const int32_t *m = mask + i * mask_st;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t word = (uint32_t)m[w];
            if (word == 0xffffffffu) continue;
            const int64_t base = w * 32;
            const int64_t lim = n - base < 32 ? n - base : 32;
            for (int64_t b = 0; b < lim; b++) {
                if (!((word >> b) & 1u)) set_neg_inf(p, base + b, dt);
            }
        }
    }
}
