/*
 * Walking a factored copy plan: a cursor over its runs in order (batched into iovec arrays
 * for one system call each), the walk of a byte range of its concatenated stream, and the
 * sharing of one plan's bytes among threads in chunks.  What copies, sums and socket
 * transfers all build on.
 */
#include "native.h"

void cursor_skip_empty(const plan_t *p, cursor_t *c) {
    while (c->t < p->nt && (p->len[c->u] == c->done)) {
        c->done = 0;
        if (++c->u == p->nu) { c->u = 0; c->t++; }
    }
}

void cursor_advance(const plan_t *p, cursor_t *c, uint64_t bytes) {
    while (bytes > 0 && c->t < p->nt) {
        uint64_t avail = p->len[c->u] - c->done;
        if (bytes < avail) { c->done += bytes; return; }
        bytes -= avail;
        c->done = 0;
        if (++c->u == p->nu) { c->u = 0; c->t++; }
    }
    cursor_skip_empty(p, c);
}

/* Fill up to `max` iovecs from the cursor without moving it; returns the count. */
size_t fill_iov(const plan_t *p, const cursor_t *c, struct iovec *a, struct iovec *b,
                       uint64_t *bytes, size_t max) {
    size_t k = 0, t = c->t, u = c->u;
    uint64_t done = c->done;
    *bytes = 0;
    while (t < p->nt && k < max) {
        uint64_t l = p->len[u] - done;
        if (l) {
            a[k].iov_base = (void *)(uintptr_t)(p->a_base[t] + p->a_off[u] + done);
            a[k].iov_len = l;
            if (b) {
                b[k].iov_base = (void *)(uintptr_t)(p->b_base[t] + p->b_off[u] + done);
                b[k].iov_len = l;
            }
            *bytes += l;
            k++;
        }
        done = 0;
        if (++u == p->nu) { u = 0; t++; }
    }
    return k;
}

/* Plans larger than this are split over several threads (the caller says how many): one
 * core rarely saturates memory bandwidth on its own. */
#define DD_PARALLEL_MIN_BYTES (8u << 20)

/* Chunks of at most 64 MiB: a deadline is checked at most that many bytes apart. */
#define DD_MAX_CHUNK ((uint64_t)64 << 20)

chunks_t chunks_for(uint64_t total, int parts, int64_t deadline_ms) {
    uint64_t chunk = ((total / ((uint64_t)parts * 8)) + 4095) & ~(uint64_t)4095;
    if (chunk < (1u << 20)) chunk = 1u << 20;
    if (chunk > DD_MAX_CHUNK) chunk = DD_MAX_CHUNK;
    return (chunks_t){total, chunk, 0, deadline_ms, 0};
}

int next_chunk(chunks_t *w, uint64_t *lo, uint64_t *hi) {
    uint64_t a = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED) * w->chunk;
    if (a >= w->total) return 0;
    if (w->deadline_ms && now_ms() > w->deadline_ms) {
        __atomic_store_n(&w->expired, 1, __ATOMIC_RELAXED);
        return 0;
    }
    *lo = a;
    *hi = w->total - a > w->chunk ? a + w->chunk : w->total;
    return 1;
}

uint64_t plan_bytes(const plan_t *p) {
    uint64_t per_t = 0;
    for (size_t u = 0; u < p->nu; u++) per_t += p->len[u];
    return per_t * p->nt;
}

/* Threads for a copy of `total` bytes: one core rarely saturates memory bandwidth alone,
 * but small copies are not worth a thread. */
int parts_for(int max_threads, uint64_t total) {
    if (total < DD_PARALLEL_MIN_BYTES || max_threads < 1) return 1;
    return max_threads > DD_MAX_THREADS ? DD_MAX_THREADS : max_threads;
}

/* Run fn on parts[0] (of n parts of `size` bytes each) on this thread and on the others
 * on threads of their own; all take chunks until none are left, so this thread does them
 * all if no thread could start. */
void run_threads(void *(*fn)(void *), void *parts, size_t size, int n) {
    pthread_t th[DD_MAX_THREADS];
    int started[DD_MAX_THREADS] = {0};
    for (int k = 1; k < n; k++)
        started[k] = pthread_create(&th[k], NULL, fn, (char *)parts + k * size) == 0;
    fn(parts);
    for (int k = 1; k < n; k++)
        if (started[k]) pthread_join(th[k], NULL);
}
