/*
 * pool.c's interface, for the kernels that run on it (linear.c): a work pool whose caller
 * never waits for a preempted thread. See pool.c for how and why.
 *
 * An item computes into the thread's own memory, then makes its stores into shared memory
 * only if ae_commit_begin returns nonzero, and calls ae_commit_end after them: another thread
 * may have computed the same item, and exactly one commits it.
 */
#ifndef AE_POOL_H
#define AE_POOL_H

#include <stddef.h>
#include <stdint.h>

/* The most rows of a product (or query tokens of a step's attention) that run on the pool;
 * larger ones run on OpenMP (see linear.c's use_pool). */
#define AE_POOL_MAX_ROWS 8
/* The most items of one job that helpers share; a larger job runs in the caller alone. */
#define AE_POOL_MAX_ITEMS 8192

struct ae_commit {
    uint64_t job; /* 0: the caller runs every item alone */
    int64_t item;
};

typedef void (*ae_pool_fn)(const void *ctx, int64_t item, const struct ae_commit *commit);

/* 1 if the calling thread now holds the pool (one holder at a time), else 0: then it runs
 * its items alone (ae_pool_run with threads 1) and must not use ae_pool_rows. */
int ae_pool_acquire(void);
void ae_pool_release(void);

/* fn(ctx, item, commit) for every item < n, on up to `threads` threads, the caller one of
 * them; returns when every item is committed. ctx (at most 256 bytes) is copied. */
void ae_pool_run(ae_pool_fn fn, const void *ctx, size_t ctx_bytes, int64_t n, int threads);

int ae_commit_begin(const struct ae_commit *commit);
void ae_commit_end(const struct ae_commit *commit);

/* The holder's buffer `slot` (0, 1 or 2) for a job's inputs: at least `bytes`, never
 * unmapped (NULL when out of memory). */
void *ae_pool_buffer(int slot, size_t bytes);

#endif
