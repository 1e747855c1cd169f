/*
 * A work pool for decode-sized steps (linear.c's products, attention.c's items for
 * decode_layers.c) whose caller never waits for a thread that is not running.
 *
 * Why: an OpenMP region ends at a barrier, so a region is as slow as its slowest thread. On a
 * machine whose cores the engine shares (the API server, the client, anything else woken for a
 * few hundred microseconds), the scheduler preempts one of the team now and then, and every
 * region it is in waits for it, as does each of the ~150 regions of a decode step after it
 * while the team falls asleep and wakes again. Measured on 2 cores, SmolLM2, one stream
 * beside a process that runs 0.7 ms out of every 7.7: a decode step 0.5-0.9 ms slower; beside
 * one that runs 0.3 ms out of every 3.3 (the same share), 1.3 ms slower.
 *
 * Here the calling thread (the master) publishes a job of independent items; it and the
 * helpers claim items one at a time, each from its own share first (see `shares`). Each item is computed into the thread's own scratch and
 * only then committed (its stores into shared memory), by whichever thread claims the commit
 * first (ae_commit_begin). When no item is left to claim, the master takes the ones still
 * open: it waits a little (about twice its own time per item) for a helper that is running,
 * and computes the item itself where the helper does not finish in that time (it was
 * preempted); the helper's result, if it ever finishes, loses the commit and is dropped. So a
 * job ends when its items are done, whoever did them, and a helper that is not running costs
 * its share of the work, not a stall. Every item computes the same numbers whichever thread
 * runs it, so the results do not depend on who did what.
 *
 * What an item may read: the job's inputs stay valid only until the job ends, and a helper
 * preempted inside an item may run on after that (its commit then fails). So the inputs a job
 * function reads must stay mapped after the job: the products read model weights and the
 * pool's own copy of the rows (ae_pool_buffer, which never shrinks or unmaps), attention the
 * KV cache and the pool's copies of its tables, each value checked before it becomes an
 * address (the next call may be rewriting them: attention.c's tile_is_sound).
 *
 * Helpers wait for the next job spinning for SPIN_NS (yielding the core to any other thread
 * that wants it), then asleep on a condition variable:
 * back-to-back jobs (one decode step's products) find them awake, and between steps they give
 * the cores back. One master at a time: a second caller (another thread) gets 0 from
 * ae_pool_acquire and runs its items itself.
 */

#define _GNU_SOURCE
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#include "ae_kernels.h"
#include "pool.h"

#define MAX_HELPERS 255   /* helper threads: the team less the master */
#define CTX_BYTES 256     /* a job's context, copied by value into each helper */
#define SPIN_NS 60000     /* how long an idle helper spins for the next job before it sleeps */
#define STEAL_MIN_NS 3000 /* the least the master waits for a helper's item before taking it */

/* The published job. `published` is a sequence lock: odd while the master writes the job,
 * even (2 x the job's number) once it is out. Helpers copy the job and keep the copy only if
 * `published` did not move meanwhile. */
static _Atomic uint64_t published;
static _Atomic(ae_pool_fn) job_fn;
static _Atomic int64_t job_items;
static _Atomic int job_team;
static _Atomic uint64_t job_ctx[CTX_BYTES / 8];
/* Per team member t, its share of the items, [n * t / team, n * (t + 1) / team), claimed from
 * the front: (job number's low 32 bits) << 32 | the next item, so a claim names its job. Each
 * thread takes its own share first, in order, so it reads one weight stream from front to
 * back as a static split would (the hardware prefetchers follow it), then the rest of the
 * others' shares. Each on its own cache line. */
struct share {
    _Atomic uint64_t next;
    char pad[56];
};
static struct share shares[MAX_HELPERS + 1];
/* Per item: job number << 2 | phase (0 open, 1 being committed, 2 done). */
static _Atomic uint64_t item_state[AE_POOL_MAX_ITEMS];
/* Tests: how long each helper sleeps after it claims an item (ae_pool_test_delay_helpers). */
static _Atomic int64_t test_helper_delay_ns;
static _Atomic int64_t items_taken_over; /* items the master computed after a helper claimed them */
/* Helpers inside an item now (ae_pool_quiesce waits for none). */
static _Atomic int64_t helpers_in_items;
/* 1: ae_pool_run returns only once no helper is inside an item (ae_pool_set_strict); -1: not
 * read yet from $ASYNCENGINE_POOL_STRICT. */
static _Atomic int strict_mode = -1;

static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cond = PTHREAD_COND_INITIALIZER;
static _Atomic int sleepers;
static _Atomic int helpers_started;
static _Atomic int master_busy;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

enum { OPEN = 0, COMMITTING = 1, DONE = 2 };

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int ae_commit_begin(const struct ae_commit *c) {
    if (c->job == 0) return 1; /* run without the pool: the caller's own */
    uint64_t open = c->job << 2 | OPEN;
    return atomic_compare_exchange_strong(&item_state[c->item], &open, c->job << 2 | COMMITTING);
}

void ae_commit_end(const struct ae_commit *c) {
    if (c->job != 0) atomic_store_explicit(&item_state[c->item], c->job << 2 | DONE, memory_order_release);
}

/* Claim the next item of member u's share of job `job`: its number, or -1 when that share has
 * none left (or the job is over). */
static int64_t claim(uint64_t job, int u, int64_t n, int team) {
    const uint64_t tag = (job & 0xffffffffu) << 32;
    const int64_t end = n * (u + 1) / team;
    for (;;) {
        uint64_t c = atomic_load_explicit(&shares[u].next, memory_order_relaxed);
        if ((c & ~(uint64_t)0xffffffffu) != tag) return -1;
        const int64_t item = (int64_t)(c & 0xffffffffu);
        if (item >= end) return -1;
        if (atomic_compare_exchange_weak(&shares[u].next, &c, c + 1)) return item;
    }
}

/* Run items of job `job` as team member `me` until none is left to claim: its own share,
 * then the others'. Returns how many it ran. */
static int64_t run_items(uint64_t job, ae_pool_fn fn, const void *ctx, int64_t n, int me,
                         int team) {
    int64_t ran = 0;
    for (int k = 0; k < team; k++) {
        const int u = (me + k) % team;
        for (;;) {
            /* A helper counts itself in before it claims: ae_pool_quiesce never misses one
             * that holds an item it has not started yet. */
            if (me != 0) atomic_fetch_add(&helpers_in_items, 1);
            const int64_t item = claim(job, u, n, team);
            if (item < 0) {
                if (me != 0) atomic_fetch_sub(&helpers_in_items, 1);
                break;
            }
            if (me != 0) {
                const int64_t delay = atomic_load_explicit(&test_helper_delay_ns, memory_order_relaxed);
                if (delay > 0) {
                    struct timespec ts = {delay / 1000000000, delay % 1000000000};
                    nanosleep(&ts, NULL);
                }
            }
            const struct ae_commit commit = {job, item};
            fn(ctx, item, &commit);
            if (me != 0) atomic_fetch_sub(&helpers_in_items, 1);
            ran++;
        }
    }
    return ran;
}

/* A consistent copy of the published job newer than `seen` (an even sequence value): spin for
 * SPIN_NS, then sleep until the master publishes one. Returns the job's sequence value. */
static uint64_t next_job(uint64_t seen, ae_pool_fn *fn, uint64_t *ctx, int64_t *n, int *team) {
    int64_t spin_until = 0;
    for (int64_t i = 0;; i++) {
        const uint64_t s = atomic_load_explicit(&published, memory_order_acquire);
        if (s != seen && !(s & 1)) {
            *fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
            *n = atomic_load_explicit(&job_items, memory_order_relaxed);
            *team = atomic_load_explicit(&job_team, memory_order_relaxed);
            for (int w = 0; w < CTX_BYTES / 8; w++)
                ctx[w] = atomic_load_explicit(&job_ctx[w], memory_order_relaxed);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&published, memory_order_relaxed) == s) return s;
            continue; /* the master was writing the next job: read again */
        }
        cpu_relax();
        if ((i & 63) != 0) continue;
        /* Give the core to any other thread that wants it (an OpenMP worker of a region that
         * follows the products, the API server): a spinning helper only waits. */
        if (i > 0) sched_yield();
        const int64_t t = now_ns();
        if (spin_until == 0) spin_until = t + SPIN_NS;
        if (t < spin_until) continue;
        /* Sleep. sleepers is raised before `published` is read again, and the master reads
         * sleepers after it publishes (both sequentially consistent), so one of the two sees
         * the other: no job is missed. */
        pthread_mutex_lock(&sleep_lock);
        atomic_fetch_add(&sleepers, 1);
        while (atomic_load(&published) == seen) pthread_cond_wait(&sleep_cond, &sleep_lock);
        atomic_fetch_sub(&sleepers, 1);
        pthread_mutex_unlock(&sleep_lock);
        spin_until = 0;
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1-based: the master is 0 */
    uint64_t seen = atomic_load(&published) & ~(uint64_t)1;
    uint64_t ctx[CTX_BYTES / 8];
    for (;;) {
        ae_pool_fn fn;
        int64_t n;
        int team;
        seen = next_job(seen, &fn, ctx, &n, &team);
        if (index < team) run_items(seen / 2, fn, ctx, n, index, team);
    }
    return NULL;
}

/* Start helpers up to `count`; 0 where none could start (the caller runs alone). */
static int ensure_helpers(int count) {
    if (count > MAX_HELPERS) count = MAX_HELPERS;
    if (atomic_load(&helpers_started) >= count) return count;
    pthread_mutex_lock(&start_lock);
    int started = atomic_load(&helpers_started);
    while (started < count) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        const int failed = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        started++;
        atomic_store(&helpers_started, started);
    }
    pthread_mutex_unlock(&start_lock);
    return started < count ? started : count;
}

/* A forked child has none of the parent's helpers: start afresh. */
static void after_fork_child(void) {
    atomic_store(&helpers_started, 0);
    atomic_store(&sleepers, 0);
    atomic_store(&master_busy, 0);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&sleep_cond, NULL);
    pthread_mutex_init(&start_lock, NULL);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

int ae_pool_acquire(void) {
    int expected = 0;
    return atomic_compare_exchange_strong(&master_busy, &expected, 1);
}

void ae_pool_release(void) { atomic_store(&master_busy, 0); }

/* Run fn(ctx, item, commit) for every item < n with up to `threads` threads, the caller one of
 * them. The caller holds the pool (ae_pool_acquire). ctx (ctx_bytes <= CTX_BYTES) is copied. */
int ae_pool_quiesce(int timeout_ms);

/* Nonzero where a job's caller must not return while a helper is still inside one of its
 * items: for tests, which free a weight right after its product (a server keeps its weights
 * for its life, and quiesces before it frees them). */
static int pool_strict(void) {
    int v = atomic_load_explicit(&strict_mode, memory_order_relaxed);
    if (v < 0) {
        const char *env = getenv("ASYNCENGINE_POOL_STRICT");
        v = env != NULL && env[0] == '1';
        atomic_store_explicit(&strict_mode, v, memory_order_relaxed);
    }
    return v;
}

/* Turn strict mode on or off (tests); returns the previous setting. */
int ae_pool_set_strict(int on) {
    const int before = pool_strict();
    atomic_store(&strict_mode, on ? 1 : 0);
    return before;
}

/* See ae_kernels.h. OpenMP's team size is a per-thread setting: other threads keep theirs. */
int ae_omp_set_threads(int n) {
#ifdef _OPENMP
    const int before = omp_get_max_threads();
    if (n > 0) omp_set_num_threads(n);
    return before;
#else
    (void)n;
    return 1;
#endif
}

void ae_pool_run(ae_pool_fn fn, const void *ctx, size_t ctx_bytes, int64_t n, int threads) {
    if (n <= 0) return;
    int helpers = threads - 1;
    if (helpers > 0 && n > 1 && n <= AE_POOL_MAX_ITEMS && ctx_bytes <= CTX_BYTES) {
        pthread_once(&fork_once, register_fork);
        helpers = ensure_helpers(helpers);
    } else {
        helpers = 0;
    }
    if (helpers <= 0) {
        for (int64_t i = 0; i < n; i++) {
            const struct ae_commit alone = {0, i};
            fn(ctx, i, &alone);
        }
        return;
    }
    const int team = helpers + 1;
    /* Publish: odd while writing, then the job's (even) value. */
    const uint64_t writing = atomic_load_explicit(&published, memory_order_relaxed) + 1;
    atomic_store_explicit(&published, writing, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    const uint64_t job = (writing + 1) / 2;
    uint64_t words[CTX_BYTES / 8] = {0};
    memcpy(words, ctx, ctx_bytes);
    for (int w = 0; w < CTX_BYTES / 8; w++)
        atomic_store_explicit(&job_ctx[w], words[w], memory_order_relaxed);
    atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job_items, n, memory_order_relaxed);
    atomic_store_explicit(&job_team, team, memory_order_relaxed);
    for (int64_t i = 0; i < n; i++)
        atomic_store_explicit(&item_state[i], job << 2 | OPEN, memory_order_relaxed);
    for (int t = 0; t < team; t++)
        atomic_store_explicit(&shares[t].next, (job & 0xffffffffu) << 32 | (uint64_t)(n * t / team),
                              memory_order_relaxed);
    atomic_store(&published, writing + 1); /* sequentially consistent: see next_job */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&sleep_cond);
        pthread_mutex_unlock(&sleep_lock);
    }
    /* The master's share, timed: its time per item sets how long it waits for others'. */
    const int64_t t0 = now_ns();
    const int64_t mine = run_items(job, fn, ctx, n, 0, team);
    const int64_t per_item = mine > 0 ? (now_ns() - t0) / mine : 0;
    const int64_t patience = 2 * per_item > STEAL_MIN_NS ? 2 * per_item : STEAL_MIN_NS;
    /* Every item claimed: finish the ones still open. */
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = atomic_load_explicit(&item_state[i], memory_order_acquire);
        if (s == (job << 2 | DONE)) continue;
        if (s == (job << 2 | OPEN)) {
            const int64_t give_up = now_ns() + patience;
            for (int k = 0; s == (job << 2 | OPEN); k++) {
                cpu_relax();
                if ((k & 15) == 0 && now_ns() > give_up) break;
                s = atomic_load_explicit(&item_state[i], memory_order_acquire);
            }
            if (s == (job << 2 | OPEN)) {
                const struct ae_commit c = {job, i};
                fn(ctx, i, &c); /* its helper is not running: take the item */
                atomic_fetch_add_explicit(&items_taken_over, 1, memory_order_relaxed);
            }
        }
        /* Being committed by a helper: its stores take well under a microsecond, unless it
         * was preempted just then; yield the core after a while, so it can run. */
        for (int k = 0; atomic_load_explicit(&item_state[i], memory_order_acquire) != (job << 2 | DONE); k++) {
            if (k < 4096) cpu_relax();
            else sched_yield();
        }
    }
    if (pool_strict()) ae_pool_quiesce(60000);
}

/* Wait (at most about `timeout_ms`) until no helper is inside an item: a helper preempted in
 * an item may run on after its job ended (see the top), reading that job's inputs. Call it
 * before freeing what jobs read (a model's weights at shutdown; a test's tensors). Returns 1
 * when the helpers are out, 0 on the timeout. */
int ae_pool_quiesce(int timeout_ms) {
    const int64_t until = now_ns() + (int64_t)timeout_ms * 1000000;
    for (int64_t k = 0; atomic_load(&helpers_in_items) > 0; k++) {
        if (k < 1024) {
            cpu_relax();
            continue;
        }
        if (now_ns() > until) return 0;
        sched_yield();
    }
    return 1;
}

/* Tests: from now on each helper sleeps `ns` after it claims an item, as if preempted there.
 * Returns how many items the master took over from helpers since the last call. */
int64_t ae_pool_test_delay_helpers(int64_t ns) {
    atomic_store(&test_helper_delay_ns, ns);
    return atomic_exchange(&items_taken_over, 0);
}

/* The holder's buffers for a job's inputs (see the top): buffer `slot` (< POOL_SLOTS) of at
 * least `bytes`, valid until the next call for that slot; it only grows, and an outgrown
 * buffer is kept, never freed, because a helper preempted inside an item may still read it. */
#define POOL_SLOTS 3
void *ae_pool_buffer(int slot, size_t bytes) {
    static void *buffers[POOL_SLOTS];
    static size_t sizes[POOL_SLOTS];
    if (slot < 0 || slot >= POOL_SLOTS) return NULL;
    if (bytes > sizes[slot]) {
        size_t want = sizes[slot] ? sizes[slot] : 4096;
        while (want < bytes) want *= 2;
        void *grown = malloc(want);
        if (grown == NULL) return NULL;
        buffers[slot] = grown; /* the old buffer is deliberately leaked: see above */
        sizes[slot] = want;
    }
    return buffers[slot];
}
