/*
 * Executors for coalesced copy plans.  A plan is factored: T base address pairs (one per
 * tensor) crossed with U runs (source offset, destination offset, length), i.e. run
 * (t, u) copies len[u] bytes from sbase[t] + soff[u] to dbase[t] + doff[u], tensor-major.
 * Keeping it factored makes plans O(T + U) to build and to send.  These run a whole plan with
 * the GIL released (they are called through ctypes) and with as few system calls as the
 * kernel allows.  Errors are returned as negative errno values; the Python side maps them
 * to the contract's exceptions.  The executors are plain C; the bottom of the file binds
 * them as module functions that take buffer objects (numpy arrays) and drop the GIL while
 * they run, so a call costs well under a microsecond of Python overhead.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <linux/sockios.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Stay below IOV_MAX (1024) so that one batch is always one system call. */
#define DD_IOV_BATCH 1024

/* Plans larger than this are split over several threads (the caller says how many): one
 * core rarely saturates memory bandwidth on its own. */
#define DD_PARALLEL_MIN_BYTES (8u << 20)
#define DD_MAX_THREADS 8

/* Copies at least this large use streaming stores (x86): their destination would not
 * stay in the cache anyway, and skipping its read-for-ownership saves a third of the
 * memory traffic (figures before and after: docs/benchmarks.md). */
#define DD_STREAM_MIN_BYTES (4u << 20)

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------- local copies */

typedef struct {
    const uint64_t *a_base, *b_base, *a_off, *b_off, *len;
    size_t nt, nu;
} plan_t;

/* Iterate over the runs of a plan in order, batching them into iovec arrays.  `pos`
 * (tensor, run, bytes done in that run) survives between batches. */
typedef struct {
    size_t t, u;
    uint64_t done;
} cursor_t;

static int cursor_end(const plan_t *p, const cursor_t *c) { return c->t >= p->nt; }

static void cursor_skip_empty(const plan_t *p, cursor_t *c) {
    while (c->t < p->nt && (p->len[c->u] == c->done)) {
        c->done = 0;
        if (++c->u == p->nu) { c->u = 0; c->t++; }
    }
}

static void cursor_advance(const plan_t *p, cursor_t *c, uint64_t bytes) {
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
static size_t fill_iov(const plan_t *p, const cursor_t *c, struct iovec *a, struct iovec *b,
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

/* ---------------------------------------------------------------- local copies */

/* The threads of one big copy take byte ranges of the plan's concatenated stream in
 * chunks from a shared counter, not a fixed share each: on a busy machine a thread that
 * loses its core would otherwise hold the whole copy up while the others sit idle. */
typedef struct {
    uint64_t total, chunk;
    uint64_t next;       /* next chunk index (atomic) */
    int64_t deadline_ms; /* no chunk starts after it (0: none); see `expired` */
    int expired;         /* set (atomic) when a chunk was left undone for the deadline */
} chunks_t;

/* Chunks of at most 64 MiB: a deadline is checked at most that many bytes apart. */
#define DD_MAX_CHUNK ((uint64_t)64 << 20)

static chunks_t chunks_for(uint64_t total, int parts, int64_t deadline_ms) {
    uint64_t chunk = ((total / ((uint64_t)parts * 8)) + 4095) & ~(uint64_t)4095;
    if (chunk < (1u << 20)) chunk = 1u << 20;
    if (chunk > DD_MAX_CHUNK) chunk = DD_MAX_CHUNK;
    return (chunks_t){total, chunk, 0, deadline_ms, 0};
}

static int next_chunk(chunks_t *w, uint64_t *lo, uint64_t *hi) {
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

#if defined(__SSE2__)
/* Copy `n` bytes (a multiple of 64), with streaming stores to a 16-byte aligned `d` when
 * `stream` is set: they skip the read-for-ownership of the destination and leave the
 * caches alone, which is what a copy many times the cache's size wants.  Also sums the
 * copied 64-bit words: *sum = sum of w_k, *wsum = sum of k * w_k for word index k from the
 * start (mod 2^64).  Per lane, s1 accumulates the words and s2 accumulates s1 after each
 * 64-byte step (Fletcher's running sum), so after m steps sum(c * w_c) = m * s1 - s2:
 * position weights with adds only, next to the memory traffic. */
static void copy_sum_simd(uint8_t *d, const uint8_t *s, uint64_t n, int stream, uint64_t *sum, uint64_t *wsum) {
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (uint64_t i = 0; i < n; i += 64) {
        __m128i w0 = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i w1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i w2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i w3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        if (stream) {
            _mm_stream_si128((__m128i *)(d + i), w0);
            _mm_stream_si128((__m128i *)(d + i + 16), w1);
            _mm_stream_si128((__m128i *)(d + i + 32), w2);
            _mm_stream_si128((__m128i *)(d + i + 48), w3);
        } else {
            _mm_storeu_si128((__m128i *)(d + i), w0);
            _mm_storeu_si128((__m128i *)(d + i + 16), w1);
            _mm_storeu_si128((__m128i *)(d + i + 32), w2);
            _mm_storeu_si128((__m128i *)(d + i + 48), w3);
        }
        a0 = _mm_add_epi64(a0, w0); a1 = _mm_add_epi64(a1, w1);
        a2 = _mm_add_epi64(a2, w2); a3 = _mm_add_epi64(a3, w3);
        b0 = _mm_add_epi64(b0, a0); b1 = _mm_add_epi64(b1, a1);
        b2 = _mm_add_epi64(b2, a2); b3 = _mm_add_epi64(b3, a3);
    }
    uint64_t s1[8], s2[8], m = n / 64, total = 0, weighted = 0;
    _mm_storeu_si128((__m128i *)s1, a0); _mm_storeu_si128((__m128i *)(s1 + 2), a1);
    _mm_storeu_si128((__m128i *)(s1 + 4), a2); _mm_storeu_si128((__m128i *)(s1 + 6), a3);
    _mm_storeu_si128((__m128i *)s2, b0); _mm_storeu_si128((__m128i *)(s2 + 2), b1);
    _mm_storeu_si128((__m128i *)(s2 + 4), b2); _mm_storeu_si128((__m128i *)(s2 + 6), b3);
    for (uint64_t lane = 0; lane < 8; lane++) { /* word 8c + lane of step c */
        total += s1[lane];
        weighted += 8 * (m * s1[lane] - s2[lane]) + lane * s1[lane];
    }
    *sum = total;
    *wsum = weighted;
}
#endif

/* memmove, with streaming stores for the 16-byte aligned body of a run that does not
 * overlap itself when `stream` is set (the caller fences). */
static void copy_run(uint8_t *d, const uint8_t *s, uint64_t n, int stream) {
#if defined(__SSE2__)
    if (stream && n >= 4096 && (d + n <= s || s + n <= d)) {
        uint64_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        uint64_t body = n & ~(uint64_t)63, unused_sum, unused_wsum;
        copy_sum_simd(d, s, body, 1, &unused_sum, &unused_wsum); /* the sums are free next to the traffic */
        memcpy(d + body, s + body, n - body);
        return;
    }
#else
    (void)stream;
#endif
    memmove(d, s, n);
}

/* ---------------------------------------------------------------- copies with block sums */

/* The same copy, also adding every copied byte into the two running sums of its 4 KiB
 * block of one value: byte k of the value is part of word i = (k % 4096) / 8 of block
 * k / 4096, and adds v = byte << 8 * (k % 8) to sums[2 * block] and (i + 1) * v to
 * sums[2 * block + 1].  So, however the runs cut it, a block's first sum is the sum
 * (mod 2^64) of its little-endian 64-bit words and its second the position-weighted sum,
 * which changes when words move within the block.  A checksum built on those sums costs
 * no pass of its own over the value: the bytes are summed while they are in registers
 * anyway.  `vbase` is the value's address on the side named by `value_is_src`; every
 * run's bytes on that side lie inside the value. */

static void copy_sum_bytes(uint8_t *d, const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums) {
    for (uint64_t i = 0; i < n; i++, o++) {
        uint64_t v = (uint64_t)s[i] << (8 * (o & 7)), *block = sums + 2 * (o >> 12);
        d[i] = s[i];
        block[0] += v;
        block[1] += (((o & 4095) >> 3) + 1) * v;
    }
}


/* Copy n bytes whose value offset starts at o, summing them into sums; `stream`: use
 * streaming stores where the destination's alignment allows (the caller fences). */
static void copy_sum(uint8_t *d, const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums, int stream) {
    uint64_t head = (8 - (o & 7)) & 7;
    if (head > n) head = n;
    copy_sum_bytes(d, s, head, o, sums);
    d += head; s += head; o += head; n -= head;
    while (n >= 8) {
        uint64_t chunk = ((o | 4095) + 1) - o; /* up to the end of o's block */
        if (chunk > n) chunk = n;
        chunk &= ~(uint64_t)7;
        uint64_t sum = 0, ws = 0, w;
        uint64_t i = 0, k = ((o & 4095) >> 3) + 1; /* the weight of the chunk's first word */
#if defined(__SSE2__)
        if (chunk >= 64) {
            uint64_t rel;
            i = chunk & ~(uint64_t)63;
            copy_sum_simd(d, s, i, stream && ((uintptr_t)d & 15) == 0, &sum, &rel);
            ws = k * sum + rel;
            k += i >> 3;
        }
#else
        (void)stream;
#endif
        for (; i < chunk; i += 8, k++) { /* the words after the last 64-byte step */
            memcpy(&w, s + i, 8);
            memcpy(d + i, &w, 8);
            sum += w;
            ws += k * w;
        }
        sums[2 * (o >> 12)] += sum;
        sums[2 * (o >> 12) + 1] += ws;
        d += chunk; s += chunk; o += chunk; n -= chunk;
    }
    copy_sum_bytes(d, s, n, o, sums);
}

/* ---------------------------------------------------------------- running a local copy */

/* One thread's share of a local copy: the plan, the shared chunk counter and, for a copy
 * with block sums, the value and this thread's own sums (merged by the caller). */
typedef struct {
    const plan_t *p;
    chunks_t *work;
    int stream;       /* streaming stores (copies well beyond the cache) */
    int summed;       /* a copy with block sums: the fields below apply */
    int by_stream;    /* the sums are the plan's stream's (offsets in plan order), not a value's */
    int value_is_src;
    uint64_t vbase;
    uint64_t *sums;
} part_t;

/* Visit the runs of bytes [lo, hi) of the plan's concatenated stream (each tensor's runs
 * in order, tensor after tensor): visit(ctx, t, u, a, from, to) for the bytes from..to of
 * run u of tensor t, which starts at stream offset a.  The one walk of a stream range that
 * copies, sums and gathers share. */
typedef void (*run_visit)(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to);

static void walk_stream(const plan_t *p, uint64_t lo, uint64_t hi, run_visit visit, void *ctx) {
    uint64_t per_t = 0;
    for (size_t u = 0; u < p->nu; u++) per_t += p->len[u];
    if (per_t == 0) return;
    for (size_t t = lo / per_t; t < p->nt; t++) {
        uint64_t pos = t * per_t;
        if (pos >= hi) return;
        for (size_t u = 0; u < p->nu && pos < hi; u++) {
            uint64_t a = pos, b = pos + p->len[u];
            pos = b;
            if (b <= lo) continue;
            visit(ctx, t, u, a, a < lo ? lo - a : 0, (b > hi ? hi : b) - a);
        }
    }
}

static void copy_piece(void *ctx, size_t t, size_t u, uint64_t a, uint64_t s, uint64_t e) {
    const part_t *w = ctx;
    const plan_t *p = w->p;
    uint64_t src = p->a_base[t] + p->a_off[u] + s, dst = p->b_base[t] + p->b_off[u] + s;
    if (w->summed)
        copy_sum((uint8_t *)(uintptr_t)dst, (const uint8_t *)(uintptr_t)src, e - s,
                 w->by_stream ? a + s : (w->value_is_src ? src : dst) - w->vbase, w->sums, w->stream);
    else
        copy_run((uint8_t *)(uintptr_t)dst, (const uint8_t *)(uintptr_t)src, e - s, w->stream);
}

/* Copy bytes [lo, hi) of the plan's concatenated stream. */
static void copy_range(const part_t *w, uint64_t lo, uint64_t hi) {
    walk_stream(w->p, lo, hi, copy_piece, (void *)w);
}

static void *copy_thread(void *arg) {
    const part_t *w = arg;
    uint64_t lo, hi;
    while (next_chunk(w->work, &lo, &hi)) copy_range(w, lo, hi);
#if defined(__SSE2__)
    if (w->stream) _mm_sfence(); /* streaming stores are weakly ordered: drain them first */
#endif
    return NULL;
}

static uint64_t plan_bytes(const plan_t *p) {
    uint64_t per_t = 0;
    for (size_t u = 0; u < p->nu; u++) per_t += p->len[u];
    return per_t * p->nt;
}

/* Threads for a copy of `total` bytes: one core rarely saturates memory bandwidth alone,
 * but small copies are not worth a thread. */
static int parts_for(int max_threads, uint64_t total) {
    if (total < DD_PARALLEL_MIN_BYTES || max_threads < 1) return 1;
    return max_threads > DD_MAX_THREADS ? DD_MAX_THREADS : max_threads;
}

/* Run fn on parts[0] (of n parts of `size` bytes each) on this thread and on the others
 * on threads of their own; all take chunks until none are left, so this thread does them
 * all if no thread could start. */
static void run_threads(void *(*fn)(void *), void *parts, size_t size, int n) {
    pthread_t th[DD_MAX_THREADS];
    int started[DD_MAX_THREADS] = {0};
    for (int k = 1; k < n; k++)
        started[k] = pthread_create(&th[k], NULL, fn, (char *)parts + k * size) == 0;
    fn(parts);
    for (int k = 1; k < n; k++)
        if (started[k]) pthread_join(th[k], NULL);
}

static void run_parts(part_t *parts, int n) { run_threads(copy_thread, parts, sizeof(part_t), n); }

/* Copy every run (a = source, b = destination); destinations must not overlap.  The plan
 * is split by bytes (4 KiB aligned chunks), not by runs, so one huge run is shared too.
 * With a deadline (ms since the monotonic epoch, 0: none) no chunk starts after it, and
 * an unfinished copy returns -ETIMEDOUT (its destination bytes are then undefined). */
static int64_t dd_copy_plan(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
                     const uint64_t *soff, const uint64_t *doff, const uint64_t *len,
                     int max_threads, int64_t deadline_ms) {
    plan_t p = {sbase, dbase, soff, doff, len, nt, nu};
    uint64_t total = plan_bytes(&p);
    int n = parts_for(max_threads, total);
    chunks_t work = chunks_for(total, n, deadline_ms);
    part_t parts[DD_MAX_THREADS];
    for (int k = 0; k < n; k++) parts[k] = (part_t){&p, &work, total >= DD_STREAM_MIN_BYTES, 0, 0, 0, 0, NULL};
    run_parts(parts, n);
    return work.expired ? -ETIMEDOUT : (int64_t)total;
}

/* The copy with block sums (two per block: `sums` holds 2 * nblocks words): of one value
 * (its address `vbase` on the side named by value_is_src), or with `by_stream` of the
 * plan's stream (the runs in plan order, from offset 0).  Returns bytes copied, or -ERANGE
 * (nothing copied) if a run leaves the value's (the stream's) nblocks blocks, -ENOMEM if a
 * helper thread's sums cannot be allocated. */
static int64_t dd_copy_plan_sum(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
                                const uint64_t *soff, const uint64_t *doff, const uint64_t *len,
                                int max_threads, int by_stream, int value_is_src, uint64_t vbase,
                                uint64_t *sums, size_t nblocks) {
    plan_t p = {sbase, dbase, soff, doff, len, nt, nu};
    const uint64_t *vb = value_is_src ? sbase : dbase, *vo = value_is_src ? soff : doff;
    uint64_t limit = (uint64_t)nblocks << 12;
    size_t nsums = 2 * nblocks;
    for (size_t t = 0; t < nt && !by_stream; t++)
        for (size_t u = 0; u < nu; u++) {
            if (!len[u]) continue;
            uint64_t o = vb[t] + vo[u] - vbase;
            if (vb[t] + vo[u] < vbase || o > limit || len[u] > limit - o) return -ERANGE;
        }
    uint64_t total = plan_bytes(&p);
    if (by_stream && total > limit) return -ERANGE;
    int n = parts_for(max_threads, total);
    chunks_t work = chunks_for(total, n, 0);
    part_t parts[DD_MAX_THREADS];
    for (int k = 0; k < n; k++) {
        parts[k] = (part_t){&p, &work, total >= DD_STREAM_MIN_BYTES, 1, by_stream, value_is_src, vbase, sums};
        if (k && !(parts[k].sums = calloc(nsums, sizeof(uint64_t)))) {
            for (int j = 1; j < k; j++) free(parts[j].sums);
            return -ENOMEM;
        }
    }
    run_parts(parts, n);
    for (int k = 1; k < n; k++) {
        for (size_t i = 0; i < nsums; i++) sums[i] += parts[k].sums[i];
        free(parts[k].sums);
    }
    return (int64_t)total;
}

/* The block sums of a byte stream as it goes by (a socket's payload, a staged window):
 * `pos` is the stream offset of the next byte; `sums` holds two words per 4 KiB block of
 * the stream (nblocks of them).  Bytes at offsets from `tail_start` on are also kept in
 * `tail` (tail_len bytes): the pool's checksum takes a value's last partial block as it
 * is, not by its sums.  No tail: tail_start is UINT64_MAX. */
typedef struct {
    uint64_t *sums;
    size_t nblocks;
    uint64_t pos;
    uint8_t *tail;
    uint64_t tail_start, tail_len;
} summer_t;

/* Whether n more bytes fit the summer's blocks (and its tail). */
static int summer_fits(const summer_t *m, uint64_t n) {
    uint64_t end = m->pos + n;
    if (end < m->pos || end > (uint64_t)m->nblocks << 12) return 0;
    return m->tail_start == UINT64_MAX || end <= m->tail_start + m->tail_len;
}

/* The two sums of the n bytes at s (a multiple of 64), as copy_sum_simd computes them but
 * without storing anything: loads and adds only, which is what summing bytes that a system
 * call just moved (so they are in the cache) costs.  AVX2 where the processor has it (four
 * words per register; the lane formula is copy_sum_simd's), else copy_sum_simd into a
 * scratch block. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2"))) static void sum_avx2(const uint8_t *s, uint64_t n, uint64_t *sum, uint64_t *wsum) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
    for (uint64_t i = 0; i < n; i += 64) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(s + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(s + i + 32)));
        b0 = _mm256_add_epi64(b0, a0);
        b1 = _mm256_add_epi64(b1, a1);
    }
    uint64_t s1[8], s2[8], m = n / 64, total = 0, weighted = 0;
    _mm256_storeu_si256((__m256i *)s1, a0); _mm256_storeu_si256((__m256i *)(s1 + 4), a1);
    _mm256_storeu_si256((__m256i *)s2, b0); _mm256_storeu_si256((__m256i *)(s2 + 4), b1);
    for (uint64_t lane = 0; lane < 8; lane++) {
        total += s1[lane];
        weighted += 8 * (m * s1[lane] - s2[lane]) + lane * s1[lane];
    }
    *sum = total;
    *wsum = weighted;
}
#define DD_HAVE_AVX2 1
#endif

/* Add the n bytes at s (value offset o on, inside one 4 KiB block) to the sums, without
 * moving them. */
static void sum_block(const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums) {
#if defined(DD_HAVE_AVX2)
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2 && !(o & 7) && n >= 64) {
        uint64_t body = n & ~(uint64_t)63, sum, rel, k = ((o & 4095) >> 3) + 1;
        sum_avx2(s, body, &sum, &rel);
        sums[2 * (o >> 12)] += sum;
        sums[2 * (o >> 12) + 1] += k * sum + rel;
        s += body; o += body; n -= body;
    }
#endif
    uint8_t scratch[4096] __attribute__((aligned(64)));
    copy_sum(scratch, s, n, o, sums, 0);
}

/* Add the n bytes at s (the stream's next ones) to the sums, without moving them: whole
 * words are summed where they lie (sum_block), the rest goes through copy_sum into a
 * block-sized scratch that stays in the L1 cache (or into the tail), so the sums are
 * those of a copy by construction.  The caller checked summer_fits. */
static void sum_piece(summer_t *m, const uint8_t *s, uint64_t n) {
    while (n) {
        uint64_t o = m->pos, take = 4096 - (o & 4095);
        if (o >= m->tail_start) {
            take = n;
            copy_sum(m->tail + (o - m->tail_start), s, take, o, m->sums, 0);
        } else {
            if (m->tail_start - o < take) take = m->tail_start - o;
            if (take > n) take = n;
            sum_block(s, take, o, m->sums);
        }
        m->pos += take;
        s += take;
        n -= take;
    }
}

/* The block sums of the whole 4 KiB blocks of the n bytes at s, added to sums (two per
 * block), without moving them. */
static void dd_sum_blocks(const uint8_t *s, uint64_t n, uint64_t *sums) {
    summer_t m = {sums, (size_t)(n >> 12), 0, NULL, UINT64_MAX, 0};
    sum_piece(&m, s, n & ~(uint64_t)4095);
}

typedef struct {
    const plan_t *p;
    uint8_t *out;
    uint64_t lo;
} gather_t;

static void gather_piece(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to) {
    const gather_t *g = ctx;
    memcpy(g->out + (a + from - g->lo), (const uint8_t *)(uintptr_t)(g->p->b_base[t] + g->p->b_off[u] + from),
           to - from);
}

/* Copy the bytes of the plan's stream (b side: the destination) from offset lo to its end
 * into out: the kept last partial block of a stream copied with block sums. */
static void gather_stream(const plan_t *p, uint64_t lo, uint8_t *out) {
    gather_t g = {p, out, lo};
    walk_stream(p, lo, plan_bytes(p), gather_piece, &g);
}

typedef struct {
    const plan_t *p;
    summer_t *m;
    uint64_t start; /* the summer's pos at the stream's offset 0 */
} sum_walk_t;

static void sum_run_piece(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to) {
    sum_walk_t *w = ctx;
    w->m->pos = w->start + a + from;
    sum_piece(w->m, (const uint8_t *)(uintptr_t)(w->p->a_base[t] + w->p->a_off[u] + from), to - from);
}

/* Add bytes [lo, hi) of the a side's stream (the runs in plan order) to the summer, whose
 * pos is the stream's offset 0 plus `start`. */
static void sum_range(const plan_t *p, summer_t *m, uint64_t start, uint64_t lo, uint64_t hi) {
    sum_walk_t w = {p, m, start};
    walk_stream(p, lo, hi, sum_run_piece, &w);
}

/* One thread's share of a plan's sums: chunks of 4 KiB aligned stream ranges, so the
 * threads add to disjoint blocks (and tail bytes) of the one shared summer. */
typedef struct {
    const plan_t *p;
    chunks_t *work;
    summer_t m;      /* this thread's cursor over the shared sums and tail */
    uint64_t start;  /* the summer's pos at the stream's offset 0 */
} sum_part_t;

static void *sum_thread(void *arg) {
    sum_part_t *w = arg;
    uint64_t lo, hi;
    while (next_chunk(w->work, &lo, &hi)) sum_range(w->p, &w->m, w->start, lo, hi);
    return NULL;
}

/* Add the a side's runs of a plan, in plan order, to the summer's stream (the caller
 * checked summer_fits): the checksum of what a transfer of that plan would move.  Large
 * plans whose stream starts on a block boundary are summed by up to max_threads threads:
 * an owner summing a one-sided copy's half reads it from memory, which one core does at
 * a fraction of the memory's bandwidth. */
static void dd_sum_plan(summer_t *m, const plan_t *p, int max_threads) {
    uint64_t total = plan_bytes(p);
    int n = (m->pos & 4095) ? 1 : parts_for(max_threads, total);
    if (n == 1) {
        sum_range(p, m, m->pos, 0, total);
        return;
    }
    chunks_t work = chunks_for(total, n, 0);
    sum_part_t parts[DD_MAX_THREADS];
    for (int k = 0; k < n; k++) parts[k] = (sum_part_t){p, &work, *m, m->pos};
    run_threads(sum_thread, parts, sizeof(sum_part_t), n);
}

/* ---------------------------------------------------------------- foreign copy functions */

/* A copy function of the shape of CUDA's cuMemcpyAsync(dst, src, bytes, stream): returns
 * 0 on success, an error code otherwise.  Taken by address, so this file needs no header
 * or library of the runtime that provides it. */
typedef int (*run_fn)(uint64_t dst, uint64_t src, size_t n, void *stream);

/* Call fn once per non-empty run, in plan order; stops at the first failure.  Returns the
 * bytes of the runs issued and stores fn's status (0, or the failing call's code). */
static uint64_t dd_call_plan(run_fn fn, void *stream, size_t nt, const uint64_t *sbase, const uint64_t *dbase,
                             size_t nu, const uint64_t *soff, const uint64_t *doff, const uint64_t *len,
                             int *status) {
    uint64_t done = 0;
    *status = 0;
    for (size_t t = 0; t < nt; t++)
        for (size_t u = 0; u < nu; u++) {
            if (!len[u]) continue;
            int rc = fn(dbase[t] + doff[u], sbase[t] + soff[u], (size_t)len[u], stream);
            if (rc) { *status = rc; return done; }
            done += len[u];
        }
    return done;
}

/* ---------------------------------------------------------------- cross-memory attach */

/* One-sided copy between this process (a side) and process `pid` (b side): write=1 moves
 * a -> b with process_vm_writev, write=0 moves b -> a with process_vm_readv.  Returns
 * bytes moved or -errno (ESRCH: peer gone, EFAULT: an address outside the peer's
 * mappings, EPERM: no ptrace access). */
static int64_t dd_cma_plan(int pid, int write, size_t nt, const uint64_t *lbase, const uint64_t *rbase,
                    size_t nu, const uint64_t *loff, const uint64_t *roff, const uint64_t *len,
                    int64_t deadline_ms) {
    plan_t p = {lbase, rbase, loff, roff, len, nt, nu};
    struct iovec liov[DD_IOV_BATCH], riov[DD_IOV_BATCH];
    cursor_t c = {0, 0, 0};
    int64_t moved = 0;
    cursor_skip_empty(&p, &c);
    while (!cursor_end(&p, &c)) {
        if (moved && deadline_ms && now_ms() > deadline_ms) return -ETIMEDOUT;
        uint64_t want;
        size_t k = fill_iov(&p, &c, liov, riov, &want, DD_IOV_BATCH);
        ssize_t r = write ? process_vm_writev(pid, liov, k, riov, k, 0)
                          : process_vm_readv(pid, liov, k, riov, k, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return -EFAULT;
        moved += r;
        cursor_advance(&p, &c, (uint64_t)r); /* a short count: the kernel capped the batch */
    }
    return moved;
}

/* ---------------------------------------------------------------- sockets */

static int wait_fd(int fd, short events, int64_t deadline_ms) {
    for (;;) {
        int64_t left = deadline_ms - now_ms();
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd pfd = {fd, events, 0};
        int r = poll(&pfd, 1, left > 1000000 ? 1000000 : (int)left);
        if (r > 0) {
            if (pfd.revents & (POLLERR | POLLNVAL)) return -EPIPE;
            return 0; /* ready, or hung up: the next call reports it */
        }
        if (r == 0) continue;
        if (errno != EINTR) return -errno;
    }
}

/* A summed stream moves at most this many payload bytes per system call, so the bytes
 * are still in the core's own cache (L2) when they are summed right after it; a larger
 * call leaves them to the shared cache or memory, and summing them costs several times
 * more.  Loopback and network sockets move this much per call at full speed. */
#ifndef DD_SUM_WINDOW
#define DD_SUM_WINDOW (256u << 10)
#endif

/* Trim the k iovecs at iov to at most cap bytes; returns how many remain. */
static size_t cap_iov(struct iovec *iov, size_t k, uint64_t cap) {
    for (size_t i = 0; i < k; i++) {
        if (iov[i].iov_len >= cap) {
            iov[i].iov_len = cap;
            return i + 1;
        }
        cap -= iov[i].iov_len;
    }
    return k;
}

/* Add the first r payload bytes of iov[0..) (those one writev or readv moved) to m. */
static void sum_iov(summer_t *m, const struct iovec *iov, uint64_t r) {
    for (size_t i = 0; r; i++) {
        uint64_t l = iov[i].iov_len < r ? iov[i].iov_len : r;
        sum_piece(m, (const uint8_t *)iov[i].iov_base, l);
        r -= l;
    }
}

/* The largest summed transfer serve_known serves (its block sums are allocated per request;
 * larger ones cost their Python path's overhead relatively little). */
#ifndef DD_FAST_SUMMED_MAX
#define DD_FAST_SUMMED_MAX (4u << 20)
#endif

/* CRC-32 (the IEEE polynomial, reflected: zlib's crc32, chained the same way). */
static uint32_t crc_table[256];

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, uint64_t n) {
    if (!crc_table[1]) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            crc_table[i] = c;
        }
    }
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* The checksum of an n-byte stream from its summer (checksum.from_block_sums): CRC-32 of
 * the sums of its whole blocks, then of its tail bytes, with n in the high half. */
static uint64_t summer_checksum(const summer_t *m, uint64_t n) {
    uint32_t crc = crc32_update(0, (const uint8_t *)m->sums, (n >> 12) * 16);
    if (n & 4095) crc = crc32_update(crc, m->tail, n & 4095);
    return (n & 0xFFFFFFFFu) << 32 | crc;
}

/* A summer for a whole n-byte stream in memory of its own (free with summer_free);
 * nblocks 0 when out of memory. */
static summer_t summer_alloc(uint64_t n) {
    summer_t m = {calloc((size_t)((n + 4095) >> 12) * 2 + 1, 8), (size_t)((n + 4095) >> 12), 0,
                  malloc((size_t)(n & 4095) + 1), n - (n & 4095), n & 4095};
    if (!m.sums || !m.tail) {
        free(m.sums);
        free(m.tail);
        m.sums = NULL;
        m.tail = NULL;
        m.nblocks = 0;
    }
    return m;
}

static void summer_free(summer_t *m) {
    free(m->sums);
    free(m->tail);
}

/* Stream the a side of a plan through a socket with writev/readv (send=1 writes the runs,
 * after `head` and before `trail` if given, in the same system calls; send=0 reads into
 * the runs, then `trail`), for at most timeout_ms.  With a summer `m` the payload's bytes
 * are added to its block sums right after each system call moved them (still in the
 * cache): a checksum of what was sent or received, at no pass of its own over memory.
 * The descriptor must be non-blocking (Python sockets with a timeout are).  Returns the
 * run bytes moved, -ETIMEDOUT, -ECONNRESET at end of stream, or -errno. */
static int64_t sock_io(int fd, int send, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len,
                       char *trail, size_t trail_len, summer_t *m) {
    int64_t deadline = now_ms() + timeout_ms;
    struct iovec iov[DD_IOV_BATCH];
    cursor_t c = {0, 0, 0};
    uint64_t total = plan_bytes(p), left = total; /* run bytes not moved yet */
    size_t head_done = 0, trail_done = 0;
    cursor_skip_empty(p, &c);
    while (left || head_done < head_len || trail_done < trail_len) {
        uint64_t want;
        size_t h = head_done < head_len;
        if (h) {
            iov[0].iov_base = (void *)(head + head_done);
            iov[0].iov_len = head_len - head_done;
        }
        /* IOV_MAX in all, one kept for the trailer */
        size_t k = h + fill_iov(p, &c, iov + h, NULL, &want, DD_IOV_BATCH - h - 1);
        if (m && want > DD_SUM_WINDOW) {
            k = h + cap_iov(iov + h, k - h, DD_SUM_WINDOW);
            want = DD_SUM_WINDOW;
        }
        if (want == left && trail_done < trail_len) { /* the runs end in this call: the trailer joins it */
            iov[k].iov_base = trail + trail_done;
            iov[k].iov_len = trail_len - trail_done;
            k++;
        }
        ssize_t r = send ? writev(fd, iov, k) : readv(fd, iov, k);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int w = wait_fd(fd, send ? POLLOUT : POLLIN, deadline);
                if (w < 0) return w;
                continue;
            }
            return -errno;
        }
        if (r == 0) return -ECONNRESET;
        if (h) {
            size_t take = (size_t)r < head_len - head_done ? (size_t)r : head_len - head_done;
            head_done += take;
            r -= (ssize_t)take;
        }
        uint64_t runs = (uint64_t)r < want ? (uint64_t)r : want;
        if (m) sum_iov(m, iov + h, runs);
        left -= runs;
        cursor_advance(p, &c, runs);
        trail_done += (uint64_t)r - runs;
    }
    return (int64_t)total;
}

/* dd_spin_readable: poll fd without sleeping for up to spin_us: 1 once readable (or hung
 * up), 0 if not by then, or -errno.
 * The spin yields the CPU between polls (a thread that shares it runs; none: the poll goes on at once).
 * dd_wait_readable: wait until fd is readable: poll without sleeping for up to spin_us first (a reply on a
 * loopback or fast link usually arrives within tens of microseconds, and a sleeping
 * thread pays a wake-up that costs about as much), then sleep in poll until timeout_ms.
 * Returns 0 when readable (or hung up), -ETIMEDOUT, or -errno. */
static int64_t dd_spin_readable(int fd, int64_t spin_us) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int r = poll(&pfd, 1, 0);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return -errno;
        clock_gettime(CLOCK_MONOTONIC, &t);
        int64_t us = (int64_t)(t.tv_sec - t0.tv_sec) * 1000000 + (t.tv_nsec - t0.tv_nsec) / 1000;
        if (us >= spin_us) return 0;
        /* Let a thread that shares this CPU run: on a machine with few cores it is often
         * the one that will make fd readable (the peer, or this process's caller). */
        sched_yield();
    }
}

static int64_t dd_wait_readable(int fd, int64_t spin_us, int64_t timeout_ms) {
    if (spin_us > 0) { /* no spin: the sleeping poll alone (a spin's first poll would be a system call more) */
        int64_t r = dd_spin_readable(fd, spin_us);
        if (r != 0) return r < 0 ? r : 0;
    }
    return wait_fd(fd, POLLIN, now_ms() + timeout_ms);
}

/* ---------------------------------------------------------------- Python bindings */

/* Fill buf (len bytes) from a non-blocking socket within timeout_ms: bytes read, or -errno. */
static int64_t dd_recv_exact(int fd, void *buf, uint64_t len, int64_t timeout_ms) {
    uint64_t addr = (uint64_t)(uintptr_t)buf, zero = 0;
    plan_t p = {&addr, &addr, &zero, &zero, &len, 1, 1};
    return len ? sock_io(fd, 0, timeout_ms, &p, NULL, 0, NULL, 0, NULL) : 0;
}

static void put_le64(uint8_t *t, uint64_t v) {
    for (int i = 0; i < 8; i++) t[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le64(const uint8_t *t) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | t[i];
    return v;
}

/* Send head, the runs of p and their stream checksum behind them (8 bytes, little
 * endian), summed into m (a fresh summer of the n = plan_bytes(p) bytes); *sum gets the
 * checksum.  A payload within DD_SUM_WINDOW is summed before the writev (which then
 * reads it from the cache), so the checksum leaves in the same system call and the
 * receiver finds it with the payload; a larger one is summed as it goes, its checksum in
 * a call of its own.  Run bytes sent or -errno, all within timeout_ms. */
static int64_t send_summed(int fd, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len,
                           summer_t *m, uint64_t n, uint64_t *sum) {
    uint8_t t[8];
    if (n <= DD_SUM_WINDOW) {
        dd_sum_plan(m, p, 1);
        put_le64(t, *sum = summer_checksum(m, n));
        return sock_io(fd, 1, timeout_ms, p, head, head_len, (char *)t, 8, NULL);
    }
    int64_t deadline = now_ms() + timeout_ms;
    int64_t r = sock_io(fd, 1, timeout_ms, p, head, head_len, NULL, 0, m);
    if (r < 0) return r;
    put_le64(t, *sum = summer_checksum(m, n));
    int64_t w = sock_io(fd, 1, deadline - now_ms(), &(plan_t){0}, (const char *)t, 8, NULL, 0, NULL);
    return w < 0 ? w : r;
}

/* Read the runs of p, summed into m (a fresh summer of their n bytes) as they arrive, and
 * the sender's checksum behind them, in the same system calls; *got gets the checksum of
 * what arrived, *sent the sender's.  Run bytes read or -errno. */
static int64_t recv_summed(int fd, int64_t timeout_ms, const plan_t *p, summer_t *m, uint64_t n, uint64_t *got,
                           uint64_t *sent) {
    uint8_t t[8];
    int64_t r = sock_io(fd, 0, timeout_ms, p, NULL, 0, (char *)t, 8, m);
    if (r < 0) return r;
    *got = summer_checksum(m, n);
    *sent = get_le64(t);
    return r;
}

/* Borrow n uint64 arrays (buffers); fails unless each holds a whole number of uint64. */
static int get_u64(PyObject *obj, Py_buffer *view, size_t *count) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "plan arrays must be uint64");
        return -1;
    }
    *count = (size_t)view->len / 8;
    return 0;
}

typedef struct {
    Py_buffer v[5];
    int held;
    size_t nt, nu;
} plan_args;

static void release_plan(plan_args *a) {
    for (int i = 0; i < a->held; i++) PyBuffer_Release(&a->v[i]);
    a->held = 0;
}

/* objs: base A, base B, off A, off B, len (B may be NULL: single-sided) */
static int get_plan(PyObject *const *objs, int nobj, plan_args *a) {
    size_t counts[5];
    a->held = 0;
    for (int i = 0; i < nobj; i++) {
        if (get_u64(objs[i], &a->v[i], &counts[i]) < 0) { release_plan(a); return -1; }
        a->held++;
    }
    a->nt = counts[0];
    a->nu = counts[nobj - 1];
    int ok = 1;
    if (nobj == 5) ok = counts[1] == a->nt && counts[2] == a->nu && counts[3] == a->nu;
    else ok = counts[1] == a->nu;
    if (!ok) {
        release_plan(a);
        PyErr_SetString(PyExc_ValueError, "plan arrays disagree in length");
        return -1;
    }
    return 0;
}

#define U64P(a, i) ((const uint64_t *)(a).v[i].buf)

/* A plan half held by get_plan (base, off, len) as a plan whose two sides are that half;
 * an empty plan when none is held. */
static plan_t half_plan(const plan_args *a) {
    if (a->held < 3) return (plan_t){0};
    return (plan_t){U64P(*a, 0), U64P(*a, 0), U64P(*a, 1), U64P(*a, 1), U64P(*a, 2), a->nt, a->nu};
}

/* Bytes a plan half held by get_plan moves; 0 when none is held. */
static uint64_t half_bytes(const plan_args *a) {
    plan_t p = half_plan(a);
    return plan_bytes(&p);
}

static PyObject *result_or_oserror(int64_t r) {
    if (r < 0) {
        errno = (int)-r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(r);
}

/* The optional trailing timeout argument (ms, 0 or absent: none) as a deadline. */
static int deadline_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, int64_t *deadline) {
    *deadline = 0;
    if (nargs <= i) return 0;
    long long ms = PyLong_AsLongLong(args[i]);
    if (ms == -1 && PyErr_Occurred()) return -1;
    if (ms > 0) *deadline = now_ms() + ms;
    return 0;
}

static PyObject *py_copy_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "copy_plan(sbase, dbase, soff, doff, len, threads[, timeout_ms])");
        return NULL;
    }
    int threads = (int)PyLong_AsLong(args[5]);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    int64_t deadline;
    if (deadline_arg(args, nargs, 6, &deadline) < 0) return NULL;
    plan_args a;
    if (get_plan(args, 5, &a) < 0) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_copy_plan(a.nt, U64P(a, 0), U64P(a, 1), a.nu, U64P(a, 2), U64P(a, 3), U64P(a, 4), threads, deadline);
    Py_END_ALLOW_THREADS
    release_plan(&a);
    return result_or_oserror(r);
}

static PyObject *py_call_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "call_plan(fn, stream, sbase, dbase, soff, doff, len)");
        return NULL;
    }
    unsigned long long fn = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (!fn) { PyErr_SetString(PyExc_ValueError, "call_plan: fn is NULL"); return NULL; }
    plan_args a;
    if (get_plan(args + 2, 5, &a) < 0) return NULL;
    uint64_t done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    done = dd_call_plan((run_fn)(uintptr_t)fn, (void *)(uintptr_t)stream, a.nt, U64P(a, 0), U64P(a, 1), a.nu,
                        U64P(a, 2), U64P(a, 3), U64P(a, 4), &status);
    Py_END_ALLOW_THREADS
    release_plan(&a);
    return Py_BuildValue("(Ki)", (unsigned long long)done, status);
}

static PyObject *py_copy_plan_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_plan_sum(sbase, dbase, soff, doff, len, threads, sums, value_base, value_is_src)");
        return NULL;
    }
    int threads = (int)PyLong_AsLong(args[5]);
    unsigned long long vbase = PyLong_AsUnsignedLongLong(args[7]);
    int value_is_src = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer sums;
    if (PyObject_GetBuffer(args[6], &sums, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (sums.len % 16) {
        PyBuffer_Release(&sums);
        PyErr_SetString(PyExc_ValueError, "sums must be uint64, two per 4 KiB block");
        return NULL;
    }
    plan_args a;
    if (get_plan(args, 5, &a) < 0) { PyBuffer_Release(&sums); return NULL; }
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_copy_plan_sum(a.nt, U64P(a, 0), U64P(a, 1), a.nu, U64P(a, 2), U64P(a, 3), U64P(a, 4), threads, 0,
                         value_is_src, (uint64_t)vbase, (uint64_t *)sums.buf, (size_t)sums.len / 16);
    Py_END_ALLOW_THREADS
    release_plan(&a);
    PyBuffer_Release(&sums);
    return result_or_oserror(r);
}

static PyObject *py_sum_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "sum_blocks(value, sums)");
        return NULL;
    }
    Py_buffer value, sums;
    if (PyObject_GetBuffer(args[0], &value, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &sums, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&value);
        return NULL;
    }
    if ((uint64_t)sums.len < (uint64_t)value.len / 4096 * 16) {
        PyBuffer_Release(&value);
        PyBuffer_Release(&sums);
        PyErr_SetString(PyExc_ValueError, "sums must hold two uint64 per whole 4 KiB block of value");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    dd_sum_blocks((const uint8_t *)value.buf, (uint64_t)value.len, (uint64_t *)sums.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&value);
    PyBuffer_Release(&sums);
    Py_RETURN_NONE;
}

/* A summer from (sums, pos, tail, tail_start): its buffers held in views[0..1] (release
 * with release_summer); tail None: no tail.  -1 with an exception set on bad arguments. */
static int get_summer(PyObject *const *args, summer_t *m, Py_buffer *views) {
    unsigned long long pos = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long tail_start = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return -1;
    views[1].buf = NULL;
    if (PyObject_GetBuffer(args[0], &views[0], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (views[0].len % 16) {
        PyBuffer_Release(&views[0]);
        PyErr_SetString(PyExc_ValueError, "sums must be uint64, two per 4 KiB block");
        return -1;
    }
    *m = (summer_t){(uint64_t *)views[0].buf, (size_t)views[0].len / 16, pos, NULL, UINT64_MAX, 0};
    if (args[2] != Py_None) {
        if (PyObject_GetBuffer(args[2], &views[1], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&views[0]);
            return -1;
        }
        m->tail = (uint8_t *)views[1].buf;
        m->tail_start = tail_start;
        m->tail_len = (uint64_t)views[1].len;
    }
    return 0;
}

static void release_summer(Py_buffer *views) {
    PyBuffer_Release(&views[0]);
    if (views[1].buf) PyBuffer_Release(&views[1]);
}

/* copy_plan_stream(sbase, dbase, soff, doff, len, threads, sums, pos, tail, tail_start):
 * copy the plan summing its stream (a summer at pos 0, as sock_plan's receiver would sum
 * it); returns bytes copied.  ERANGE (nothing copied) unless the stream fits the summer. */
static PyObject *py_copy_plan_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_plan_stream(sbase, dbase, soff, doff, len, threads, sums, pos, tail, tail_start)");
        return NULL;
    }
    int threads = (int)PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    summer_t m;
    Py_buffer sviews[2] = {{0}, {0}};
    if (get_summer(args + 6, &m, sviews) < 0) return NULL;
    plan_args a;
    if (get_plan(args, 5, &a) < 0) { release_summer(sviews); return NULL; }
    plan_t p = {U64P(a, 0), U64P(a, 1), U64P(a, 2), U64P(a, 3), U64P(a, 4), a.nt, a.nu};
    uint64_t total = plan_bytes(&p);
    int64_t r = -ERANGE;
    if (m.pos == 0 && summer_fits(&m, total)) {
        Py_BEGIN_ALLOW_THREADS
        r = dd_copy_plan_sum(a.nt, p.a_base, p.b_base, a.nu, p.a_off, p.b_off, p.len, threads, 1, 0, 0, m.sums,
                             m.nblocks);
        if (r >= 0 && m.tail && m.tail_start < total) gather_stream(&p, m.tail_start, m.tail);
        Py_END_ALLOW_THREADS
    }
    release_plan(&a);
    release_summer(sviews);
    return result_or_oserror(r);
}

/* sum_plan(base, off, len, sums, pos, tail, tail_start[, threads]): add the runs of a plan
 * half, in plan order, to a summer (with up to `threads` threads, default 1); returns their
 * bytes.  ERANGE unless they fit the summer. */
static PyObject *py_sum_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "sum_plan(base, off, len, sums, pos, tail, tail_start[, threads])");
        return NULL;
    }
    int threads = nargs == 8 ? (int)PyLong_AsLong(args[7]) : 1;
    if (PyErr_Occurred()) return NULL;
    summer_t m;
    Py_buffer sviews[2] = {{0}, {0}};
    if (get_summer(args + 3, &m, sviews) < 0) return NULL;
    plan_args a;
    if (get_plan(args, 3, &a) < 0) { release_summer(sviews); return NULL; }
    plan_t p = half_plan(&a);
    uint64_t total = plan_bytes(&p);
    int64_t r = -ERANGE;
    if (summer_fits(&m, total)) {
        Py_BEGIN_ALLOW_THREADS
        dd_sum_plan(&m, &p, threads);
        Py_END_ALLOW_THREADS
        r = (int64_t)total;
    }
    release_plan(&a);
    release_summer(sviews);
    return result_or_oserror(r);
}

/* sum_stream(data, sums, pos, tail, tail_start): add data (the stream's bytes from pos
 * on) to a summer, as sock_plan does with what it moves; returns len(data). */
static PyObject *py_sum_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "sum_stream(data, sums, pos, tail, tail_start)");
        return NULL;
    }
    summer_t m;
    Py_buffer sviews[2] = {{0}, {0}}, data;
    if (get_summer(args + 1, &m, sviews) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_C_CONTIGUOUS) < 0) { release_summer(sviews); return NULL; }
    int64_t r = (int64_t)data.len;
    if (!summer_fits(&m, (uint64_t)data.len))
        r = -ERANGE;
    else {
        Py_BEGIN_ALLOW_THREADS
        sum_piece(&m, (const uint8_t *)data.buf, (uint64_t)data.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    release_summer(sviews);
    return result_or_oserror(r);
}

static PyObject *py_cma_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cma_plan(pid, write, lbase, rbase, loff, roff, len[, timeout_ms])");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]);
    int write = PyObject_IsTrue(args[1]);
    if ((pid == -1 || write < 0) && PyErr_Occurred()) return NULL;
    int64_t deadline;
    if (deadline_arg(args, nargs, 7, &deadline) < 0) return NULL;
    plan_args a;
    if (get_plan(args + 2, 5, &a) < 0) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_cma_plan((int)pid, write, a.nt, U64P(a, 0), U64P(a, 1), a.nu, U64P(a, 2), U64P(a, 3), U64P(a, 4),
                    deadline);
    Py_END_ALLOW_THREADS
    release_plan(&a);
    return result_or_oserror(r);
}

/* The arguments (fd, send, timeout_ms, base, off, len[, head]) of sock_plan and
 * sock_summed: the plan's arrays held in a and head's buffer in head (buf NULL: none; only
 * for sending). */
typedef struct {
    long fd;
    int send;
    long long timeout_ms;
    plan_args a;
    Py_buffer head;
} sock_args_t;

/* Parse them into c; -1 with an exception set, nothing held. */
static int sock_args(PyObject *const *args, Py_ssize_t nargs, sock_args_t *c) {
    c->fd = PyLong_AsLong(args[0]);
    c->send = PyObject_IsTrue(args[1]);
    c->timeout_ms = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return -1;
    if (get_plan(args + 3, 3, &c->a) < 0) return -1;
    c->head.buf = NULL;
    if (nargs >= 7 && args[6] != Py_None) {
        if (!c->send) { release_plan(&c->a); PyErr_SetString(PyExc_ValueError, "head is for sending"); return -1; }
        if (PyObject_GetBuffer(args[6], &c->head, PyBUF_SIMPLE) < 0) { release_plan(&c->a); return -1; }
    }
    return 0;
}

static void release_sock_args(sock_args_t *c) {
    if (c->head.buf) PyBuffer_Release(&c->head);
    release_plan(&c->a);
}

static PyObject *py_sock_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7 && nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "sock_plan(fd, send, timeout_ms, base, off, len[, head[, sums, pos, tail, tail_start]])");
        return NULL;
    }
    sock_args_t c;
    if (sock_args(args, nargs, &c) < 0) return NULL;
    summer_t m;
    Py_buffer sviews[2] = {{0}, {0}};
    int summed = nargs == 11;
    if (summed && get_summer(args + 7, &m, sviews) < 0) {
        release_sock_args(&c);
        return NULL;
    }
    int64_t r;
    if (summed && !summer_fits(&m, half_bytes(&c.a)))
        r = -ERANGE; /* the stream would leave the sums (or the tail): nothing moved */
    else {
        Py_BEGIN_ALLOW_THREADS
        plan_t p = half_plan(&c.a);
        r = sock_io((int)c.fd, c.send, c.timeout_ms, &p, (const char *)c.head.buf, c.head.buf ? (size_t)c.head.len : 0,
                    NULL, 0, summed ? &m : NULL);
        Py_END_ALLOW_THREADS
    }
    if (summed) release_summer(sviews);
    release_sock_args(&c);
    return result_or_oserror(r);
}

/* sock_summed(fd, send, timeout_ms, base, off, len[, head]): a summed payload of 1 ..
 * FAST_SUMMED_MAX bytes through a non-blocking socket in one call: send=1 writes head
 * (if given), the runs and their stream checksum (8 bytes, little endian; send_summed),
 * and returns the checksum; send=0 reads the runs, summing them, and the sender's
 * checksum in the same system calls, and returns (checksum of what arrived, the
 * sender's).  All within timeout_ms; OSError as sock_plan. */
static PyObject *py_sock_summed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "sock_summed(fd, send, timeout_ms, base, off, len[, head])");
        return NULL;
    }
    sock_args_t c;
    if (sock_args(args, nargs, &c) < 0) return NULL;
    uint64_t nbytes = half_bytes(&c.a);
    if (nbytes == 0 || nbytes > DD_FAST_SUMMED_MAX) {
        release_sock_args(&c);
        PyErr_SetString(PyExc_ValueError, "sock_summed: a summed payload must be 1 .. FAST_SUMMED_MAX bytes");
        return NULL;
    }
    summer_t m = summer_alloc(nbytes);
    if (m.nblocks == 0) {
        release_sock_args(&c);
        return PyErr_NoMemory();
    }
    uint64_t mine = 0, theirs = 0;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    plan_t p = half_plan(&c.a);
    if (c.send)
        r = send_summed((int)c.fd, c.timeout_ms, &p, (const char *)c.head.buf, c.head.buf ? (size_t)c.head.len : 0,
                        &m, nbytes, &mine);
    else
        r = recv_summed((int)c.fd, c.timeout_ms, &p, &m, nbytes, &mine, &theirs);
    Py_END_ALLOW_THREADS
    summer_free(&m);
    release_sock_args(&c);
    if (r < 0) return result_or_oserror(r);
    return c.send ? PyLong_FromUnsignedLongLong(mine) : Py_BuildValue("(KK)", (unsigned long long)mine,
                                                                    (unsigned long long)theirs);
}

static PyObject *py_wait_readable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "wait_readable(fd, spin_us, timeout_ms)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    long long spin = PyLong_AsLongLong(args[1]);
    long long timeout_ms = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_wait_readable((int)fd, spin, timeout_ms);
    Py_END_ALLOW_THREADS
    return result_or_oserror(r);
}

/* recv_exact(fd, buffer, timeout_ms): fill the whole writable buffer from a non-blocking
 * socket, polling only when no data is ready (Python's own timeout mode polls before
 * every read).  Returns the bytes read; OSError ETIMEDOUT / ECONNRESET (end of stream). */
static PyObject *py_recv_exact(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "recv_exact(fd, buffer, timeout_ms)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    long long timeout_ms = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[1], &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_recv_exact((int)fd, buf.buf, (uint64_t)buf.len, timeout_ms);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return result_or_oserror(r);
}

/* The value of an exact int (never a bool or a subclass) that fits int64: 0 and *out set,
 * or -1 (no error set).  One- and zero-digit ints, which block indices are, are read
 * straight from the object on CPython 3.11; anything else goes through the API. */
static inline int dd_exact_int(PyObject *x, int64_t *out) {
    if (Py_TYPE(x) != &PyLong_Type) return -1;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(x);
    if (size == 0) { *out = 0; return 0; }
    if (size == 1) { *out = (int64_t)((PyLongObject *)x)->ob_digit[0]; return 0; }
    if (size == -1) { *out = -(int64_t)((PyLongObject *)x)->ob_digit[0]; return 0; }
#endif
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return -1; }
    *out = v;
    return 0;
}

/* A list or tuple of Python ints as int64 bytes, with its smallest and largest value, in
 * one pass: turning a 4096-entry block list into an array is most of planning a transfer,
 * and numpy's generic conversion of a list costs several times this.  Returns None for
 * anything else (the caller takes the general path), TypeError for an entry that is not an
 * int (bool included), OverflowError for one outside int64. */
static PyObject *py_index_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "index_array(seq)"); return NULL; }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    int64_t *v = (int64_t *)PyByteArray_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t lo = 0, hi = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = items[i];
        int64_t k;
        if (dd_exact_int(x, &k) < 0) {  /* anything but an exact int that fits, which is read from the object */
            if (!PyLong_Check(x) || PyBool_Check(x)) {
                Py_DECREF(out);
                PyErr_Format(PyExc_TypeError, "entry %zd is %s, not an int", i, Py_TYPE(x)->tp_name);
                return NULL;
            }
            k = PyLong_AsLongLong(x);
            if (k == -1 && PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        }
        v[i] = k;
        if (i == 0 || k < lo) lo = k;
        if (i == 0 || k > hi) hi = k;
    }
    return Py_BuildValue("(NLL)", out, (long long)lo, (long long)hi);
}

/* request(fd, head, base, off, len, answer_len, spin_us, timeout_ms[, summed]): one request
 * of a link and the first bytes of its answer, in one call without the GIL: writev of the
 * frame head and the runs (base x off, len; base None: no payload), with summed the runs'
 * stream checksum behind them (8 bytes, little endian; at most FAST_SUMMED_MAX bytes of
 * runs, else ValueError), a wait for the answer (spinning spin_us first), and exactly
 * answer_len bytes of it, returned as bytes.  OSError ETIMEDOUT at the deadline
 * (timeout_ms for the whole call), ECONNRESET at end of stream. */
static PyObject *py_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "request(fd, head, base, off, len, answer_len, spin_us, timeout_ms[, summed])");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    Py_ssize_t answer_len = PyLong_AsSsize_t(args[5]);
    long long spin_us = PyLong_AsLongLong(args[6]), timeout_ms = PyLong_AsLongLong(args[7]);
    int summed = nargs == 9 ? PyObject_IsTrue(args[8]) : 0;
    if (PyErr_Occurred()) return NULL;
    if (answer_len < 1 || answer_len > 4096) {
        PyErr_SetString(PyExc_ValueError, "request: answer_len must be in [1, 4096]");
        return NULL;
    }
    plan_args a = {.held = 0, .nt = 0, .nu = 0};
    if (args[2] != Py_None) {
        if (get_plan(args + 2, 3, &a) < 0) return NULL;
        if (a.nt && !a.nu) {
            release_plan(&a);
            PyErr_SetString(PyExc_ValueError, "plan arrays disagree in length");
            return NULL;
        }
    }
    summer_t m = {NULL, 0, 0, NULL, UINT64_MAX, 0};
    uint64_t nbytes = 0;
    if (summed) {
        nbytes = half_bytes(&a);
        if (nbytes == 0 || nbytes > DD_FAST_SUMMED_MAX) {
            release_plan(&a);
            PyErr_SetString(PyExc_ValueError, "request: a summed payload must be 1 .. FAST_SUMMED_MAX bytes");
            return NULL;
        }
        if ((m = summer_alloc(nbytes)).nblocks == 0) { release_plan(&a); return PyErr_NoMemory(); }
    }
    Py_buffer head;
    if (PyObject_GetBuffer(args[1], &head, PyBUF_SIMPLE) < 0) { summer_free(&m); release_plan(&a); return NULL; }
    PyObject *answer = PyBytes_FromStringAndSize(NULL, answer_len);
    if (answer == NULL) { summer_free(&m); PyBuffer_Release(&head); release_plan(&a); return NULL; }
    char *ans = PyBytes_AS_STRING(answer);
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ms() + timeout_ms;
    plan_t p = half_plan(&a);
    uint64_t sum;
    r = summed ? send_summed((int)fd, timeout_ms, &p, (const char *)head.buf, (size_t)head.len, &m, nbytes, &sum)
               : sock_io((int)fd, 1, timeout_ms, &p, (const char *)head.buf, (size_t)head.len, NULL, 0, NULL);
    if (r >= 0) r = dd_wait_readable((int)fd, spin_us, deadline - now_ms());
    if (r >= 0) r = dd_recv_exact((int)fd, ans, (uint64_t)answer_len, deadline - now_ms());
    Py_END_ALLOW_THREADS
    summer_free(&m);
    PyBuffer_Release(&head);
    release_plan(&a);
    if (r < 0) { Py_DECREF(answer); return result_or_oserror(r); }
    return answer;
}

/* Whether a transfer's bytes move now, without waiting for the peer: a push's need bytes
 * (payload and checksum) are all in the socket's receive buffer; a pull's (answer, payload
 * and checksum) fit what its send buffer has free, taken as half of SO_SNDBUF, which the
 * kernel counts with its own overhead.  Two non-blocking system calls. */
static int moves_now(int fd, int push, uint64_t need) {
    int n = 0, sndbuf = 0;
    socklen_t len = sizeof sndbuf;
    if (push) return ioctl(fd, FIONREAD, &n) == 0 && (uint64_t)n >= need;
    return ioctl(fd, SIOCOUTQ, &n) == 0 && getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) == 0 &&
           (uint64_t)n + need <= (uint64_t)sndbuf / 2;
}

static PyObject *py_moves_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "moves_now(fd, push, need)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    int push = PyObject_IsTrue(args[1]);
    unsigned long long need = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(moves_now((int)fd, push, need));
}

/* serve_known(fd, known, epoch, header_size, limit, timeout_ms, answer, defer): the agent's fast
 * path for a transfer request that repeats one it checked and admitted before.
 *
 * Reads the next frame's header (header_size bytes; a frame header ends with its two
 * little-endian uint32 lengths, body and arrays) and, if the whole frame is at most limit
 * bytes, the rest of it.  When those bytes are a key of the dict known whose value is a
 * tuple (admitted_epoch, is_push, admitted, bases, offs, lens, summed) and admitted_epoch
 * equals epoch (the registry has not changed since the frame was checked), the request is
 * served here without the GIL: a push's payload is read into the runs (bases x offs, lens)
 * and answer is sent; a pull is answered with answer followed by the runs' bytes.  A
 * summed transfer of at most DD_FAST_SUMMED_MAX bytes is summed as it moves (the stream
 * checksum of checksum.py): a pull's payload is followed by its checksum (8 bytes, little
 * endian); a push's checksum is read after its payload and answer is sent only if the
 * bytes that arrived sum to it.  Nothing of the frame is trusted before it matched a frame
 * checked in full: lengths only bound what is read, never more than limit.  With defer
 * true, a transfer whose bytes would wait for the peer (moves_now: a push's payload not all
 * arrived, a pull's answer larger than its send buffer has free) is not served here: the
 * caller serves it off the thread that serves every link.
 *
 * Returns (0, admitted) when served, (1, header) when the frame is longer than limit
 * (nothing past its header read), (2, frame) when it was read whole but is not served
 * here, (3, admitted, got, sent) when a summed push arrived whole but its bytes sum to got
 * against the sender's sent (nothing answered: the caller refuses it); OSError
 * (ETIMEDOUT, ECONNRESET, ...) when the socket fails. */
static PyObject *py_serve_known(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "serve_known(fd, known, epoch, header_size, limit, timeout_ms, answer, defer)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    PyObject *known = args[1], *epoch = args[2];
    Py_ssize_t hsize = PyLong_AsSsize_t(args[3]), limit = PyLong_AsSsize_t(args[4]);
    long long timeout_ms = PyLong_AsLongLong(args[5]);
    int defer = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (!PyDict_Check(known) || !PyBytes_Check(args[6]) || hsize < 8 || hsize > 64 || limit < hsize) {
        PyErr_SetString(PyExc_ValueError, "serve_known: a dict, a header of 8..64 bytes, limit >= header, bytes answer");
        return NULL;
    }
    unsigned char head[64];
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_recv_exact((int)fd, head, (uint64_t)hsize, timeout_ms);
    Py_END_ALLOW_THREADS
    if (r < 0) return result_or_oserror(r);
    const unsigned char *l = head + hsize - 8;
    uint64_t blen = (uint64_t)l[0] | (uint64_t)l[1] << 8 | (uint64_t)l[2] << 16 | (uint64_t)l[3] << 24;
    uint64_t alen = (uint64_t)l[4] | (uint64_t)l[5] << 8 | (uint64_t)l[6] << 16 | (uint64_t)l[7] << 24;
    if ((uint64_t)hsize + blen + alen > (uint64_t)limit)
        return Py_BuildValue("(iy#)", 1, (const char *)head, hsize);
    Py_ssize_t total = hsize + (Py_ssize_t)(blen + alen);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, total);
    if (frame == NULL) return NULL;
    char *fb = PyBytes_AS_STRING(frame);
    memcpy(fb, head, (size_t)hsize);
    /* this bytes object is not shared yet: filled without the GIL */
    Py_BEGIN_ALLOW_THREADS
    r = dd_recv_exact((int)fd, fb + hsize, blen + alen, timeout_ms);
    Py_END_ALLOW_THREADS
    if (r < 0) { Py_DECREF(frame); return result_or_oserror(r); }
    PyObject *value = PyDict_GetItemWithError(known, frame);  /* borrowed */
    if (value == NULL && PyErr_Occurred()) { Py_DECREF(frame); return NULL; }
    int same = 0;
    if (value != NULL && PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) >= 7) {
        same = PyObject_RichCompareBool(PyTuple_GET_ITEM(value, 0), epoch, Py_EQ);
        if (same < 0) { Py_DECREF(frame); return NULL; }
    }
    if (!same) return Py_BuildValue("(iN)", 2, frame);
    Py_INCREF(value);  /* the dict may change once the GIL is released */
    /* kind: 0 a pull, 1 a push, 2 a SUM (item 6 its SUMMED answer, whose checksum goes at
     * byte offset item 7) */
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(value, 1));
    int push = kind == 1, summed = kind == 2 || PyObject_IsTrue(PyTuple_GET_ITEM(value, 6));
    const char *ans = PyBytes_AS_STRING(args[6]);
    size_t ans_len = (size_t)PyBytes_GET_SIZE(args[6]);
    Py_ssize_t at = -1;
    if (kind == 2 && PyTuple_GET_SIZE(value) == 8 && PyBytes_Check(PyTuple_GET_ITEM(value, 6))) {
        ans = PyBytes_AS_STRING(PyTuple_GET_ITEM(value, 6));
        ans_len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(value, 6));
        at = PyLong_AsSsize_t(PyTuple_GET_ITEM(value, 7));
    }
    plan_args a;
    int planned = kind < 0 || kind > 2 || (kind == 2 && (at < 0 || (size_t)at + 8 > ans_len || ans_len > 64))
                      ? -1 : get_plan(&PyTuple_GET_ITEM(value, 3), 3, &a);
    if (planned < 0 && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError)) {
        Py_DECREF(value);
        Py_DECREF(frame);
        return NULL;
    }
    if (planned < 0 && !PyErr_Occurred()) {  /* not a tuple this path serves */
        Py_DECREF(value);
        return Py_BuildValue("(iN)", 2, frame);
    }
    uint64_t nbytes = half_bytes(&a);
    if (defer && kind < 2 && !moves_now((int)fd, push, nbytes + (summed ? 8 : 0) + (push ? 0 : ans_len)))
        planned = -1;  /* it would wait for the peer: the Python path hands it to a thread of its own */
    if (planned < 0 || a.nu == 0 || a.nt == 0 || (summed && (nbytes == 0 || nbytes > DD_FAST_SUMMED_MAX))) {
        PyErr_Clear();  /* not a plan to serve here */
        release_plan(&a);
        Py_DECREF(value);
        return Py_BuildValue("(iN)", 2, frame);
    }
    summer_t m = {NULL, 0, 0, NULL, UINT64_MAX, 0};
    if (summed && (m = summer_alloc(nbytes)).nblocks == 0) {
        release_plan(&a);
        Py_DECREF(value);
        Py_DECREF(frame);
        return PyErr_NoMemory();
    }
    uint64_t got = 0, sent = 0;
    Py_BEGIN_ALLOW_THREADS
    plan_t p = half_plan(&a);
    if (kind == 2) {  /* the half read now, its checksum in the answer; no payload either way */
        uint8_t out[64];
        dd_sum_plan(&m, &p, 1);
        memcpy(out, ans, ans_len);
        put_le64(out + at, got = sent = summer_checksum(&m, nbytes));
        r = sock_io((int)fd, 1, timeout_ms, &(plan_t){0}, (const char *)out, ans_len, NULL, 0, NULL);
    } else if (push) {
        r = summed ? recv_summed((int)fd, timeout_ms, &p, &m, nbytes, &got, &sent)
                   : sock_io((int)fd, 0, timeout_ms, &p, NULL, 0, NULL, 0, NULL);
        if (r >= 0 && got == sent) r = sock_io((int)fd, 1, timeout_ms, &(plan_t){0}, ans, ans_len, NULL, 0, NULL);
    } else {
        r = summed ? send_summed((int)fd, timeout_ms, &p, ans, ans_len, &m, nbytes, &got)
                   : sock_io((int)fd, 1, timeout_ms, &p, ans, ans_len, NULL, 0, NULL);
        sent = got;
    }
    Py_END_ALLOW_THREADS
    if (summed) summer_free(&m);
    release_plan(&a);
    Py_DECREF(frame);
    if (r < 0) { Py_DECREF(value); return result_or_oserror(r); }
    PyObject *out = got == sent ? Py_BuildValue("(iO)", 0, PyTuple_GET_ITEM(value, 2))
                                : Py_BuildValue("(iOKK)", 3, PyTuple_GET_ITEM(value, 2), (unsigned long long)got,
                                                (unsigned long long)sent);
    Py_DECREF(value);
    return out;
}

/* Values a peer's plan half may hold: below 2^62 an address plus an offset plus a length
 * never wraps around 64 bits (no process maps memory that high). */
#define DD_HALF_VALUE_MAX (1ull << 62)

/* half_extent(bases, offs, lens) -> (total, end) or None: in one pass over a plan half
 * from a peer, the sum of its run lengths and the largest offset + length; None when offs
 * and lens differ in length, any value (the bases too) is 2^62 or more (nothing computed
 * from them could then be trusted not to wrap), or the half has bases and no run (the
 * copy and send loops take at least one), runs and no base, or an empty run (plans are
 * coalesced: empty runs are dropped).  A half of nothing at all is (0, 0). */
static PyObject *py_half_extent(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "half_extent(bases, offs, lens)"); return NULL; }
    plan_args a;
    if (get_plan(args, 3, &a) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        PyErr_Clear();  /* lengths that disagree: not a plan half */
        Py_RETURN_NONE;
    }
    const uint64_t *base = U64P(a, 0), *off = U64P(a, 1), *len = U64P(a, 2);
    uint64_t total = 0, end = 0, bad = (a.nt == 0) != (a.nu == 0);
    for (size_t i = 0; i < a.nt; i++) bad |= base[i] >= DD_HALF_VALUE_MAX;
    for (size_t i = 0; i < a.nu; i++) {
        bad |= (off[i] >= DD_HALF_VALUE_MAX) | (len[i] >= DD_HALF_VALUE_MAX) | (len[i] == 0);
        total += len[i];  /* below 2^62 before and after each step, or bad (which stays set) */
        bad |= total >= DD_HALF_VALUE_MAX;
        if (off[i] + len[i] > end) end = off[i] + len[i];
    }
    release_plan(&a);
    if (bad) Py_RETURN_NONE;
    return Py_BuildValue("(KK)", (unsigned long long)total, (unsigned long long)end);
}

/* coalesce(src, dst, lens) -> (src, dst, lens) as three bytearrays of uint64: the runs in
 * order, empty ones dropped, each merged into the one before it when it continues it on
 * both sides.  One pass (numpy needs several, each with its temporaries). */
static PyObject *py_coalesce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "coalesce(src, dst, lens)"); return NULL; }
    plan_args a;
    if (get_plan(args, 3, &a) < 0) return NULL;
    if (a.nt != a.nu) {
        release_plan(&a);
        PyErr_SetString(PyExc_ValueError, "coalesce: arrays differ in length");
        return NULL;
    }
    size_t n = a.nu;
    PyObject *out[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        out[i] = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(uint64_t)));
        if (out[i] == NULL) {
            for (int j = 0; j < i; j++) Py_DECREF(out[j]);
            release_plan(&a);
            return NULL;
        }
    }
    const uint64_t *src = U64P(a, 0), *dst = U64P(a, 1), *len = U64P(a, 2);
    uint64_t *os = (uint64_t *)PyByteArray_AS_STRING(out[0]), *od = (uint64_t *)PyByteArray_AS_STRING(out[1]),
             *ol = (uint64_t *)PyByteArray_AS_STRING(out[2]);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (len[i] == 0) continue;
        if (k && os[k - 1] + ol[k - 1] == src[i] && od[k - 1] + ol[k - 1] == dst[i]) {
            ol[k - 1] += len[i];
            continue;
        }
        os[k] = src[i];
        od[k] = dst[i];
        ol[k] = len[i];
        k++;
    }
    release_plan(&a);
    for (int i = 0; i < 3; i++) {
        if (PyByteArray_Resize(out[i], (Py_ssize_t)(k * sizeof(uint64_t))) < 0) {
            for (int j = 0; j < 3; j++) Py_DECREF(out[j]);
            return NULL;
        }
    }
    return Py_BuildValue("(NNN)", out[0], out[1], out[2]);
}

/* spin_readable(fd, spin_us): whether fd becomes readable within spin_us, polling without
 * sleeping (and without the GIL) meanwhile. */
static PyObject *py_spin_readable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "spin_readable(fd, spin_us)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    long long spin_us = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = dd_spin_readable((int)fd, spin_us);
    Py_END_ALLOW_THREADS
    if (r < 0) { errno = (int)-r; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyBool_FromLong((long)r);
}

/* Block lists as dict keys.  A plain call that repeats a call shape finds its plan by its
 * block lists, which may hold thousands of entries: a tuple of them costs a conversion, a
 * hash that visits every int object and an element-wise compare, tens of microseconds at
 * 4096 entries.  An IntKey is the values themselves as int64 with a hash computed in the
 * same single pass; equal keys compare with one memcmp. */
typedef struct {
    PyObject_VAR_HEAD
    Py_hash_t hash;
    int64_t v[1];
} IntKey;

static Py_hash_t intkey_hash(PyObject *self) { return ((IntKey *)self)->hash; }

static PyObject *intkey_richcompare(PyObject *a, PyObject *b, int op);

static PyObject *intkey_repr(PyObject *self) {
    return PyUnicode_FromFormat("IntKey(%zd ints)", Py_SIZE(self));
}

static PyTypeObject IntKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "datadist.engine._native.IntKey",
    .tp_basicsize = offsetof(IntKey, v),
    .tp_itemsize = sizeof(int64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A list of exact ints as a hashable key (made by int_key).",
    .tp_hash = intkey_hash,
    .tp_richcompare = intkey_richcompare,
    .tp_repr = intkey_repr,
};

static PyObject *intkey_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != &IntKeyType || Py_TYPE(b) != &IntKeyType)
        Py_RETURN_NOTIMPLEMENTED;
    IntKey *x = (IntKey *)a, *y = (IntKey *)b;
    int eq = Py_SIZE(x) == Py_SIZE(y) && x->hash == y->hash &&
             memcmp(x->v, y->v, (size_t)Py_SIZE(x) * sizeof(int64_t)) == 0;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

/* RefKey: two block lists as a dict key by the identity of their entries.  Reading a
 * Python int costs a visit to its object (about 1.6 ns each on a virtual machine: 13 us
 * for two lists of 4096), while the lists' arrays of entry pointers are contiguous, so a
 * key over the pointers costs a fraction of that.  A probe (ref_key) holds the two lists
 * and hashes their entry pointers; a pinned key (RefKey.pinned(), what a memory keeps)
 * holds a reference to every entry, so no other object can take an entry's address while
 * it is kept: a probe equal to a pinned key holds the very same int objects, hence the same
 * values.  Only keys whose entries are all exact ints are pinned. */
typedef struct {
    PyObject_HEAD
    Py_hash_t hash;
    Py_ssize_t n[2];
    PyObject *seq[2];   /* a probe's two lists or tuples (entries read live); NULL when pinned */
    PyObject **items;   /* a pinned key's n[0] + n[1] entries (owned); NULL for a probe */
} RefKey;

static PyTypeObject RefKeyType;

static PyObject **refkey_items(RefKey *k, int i) {
    if (k->items != NULL) return k->items + (i ? k->n[0] : 0);
    return PySequence_Fast_ITEMS(k->seq[i]);
}

static int refkey_sizes_hold(RefKey *k) {
    return k->items != NULL ||
           (PySequence_Fast_GET_SIZE(k->seq[0]) == k->n[0] && PySequence_Fast_GET_SIZE(k->seq[1]) == k->n[1]);
}

static void refkey_dealloc(PyObject *self) {
    RefKey *k = (RefKey *)self;
    Py_XDECREF(k->seq[0]);
    Py_XDECREF(k->seq[1]);
    if (k->items != NULL) {
        for (Py_ssize_t i = 0; i < k->n[0] + k->n[1]; i++) Py_DECREF(k->items[i]);
        PyMem_Free(k->items);
    }
    Py_TYPE(self)->tp_free(self);
}

static Py_hash_t refkey_hash(PyObject *self) { return ((RefKey *)self)->hash; }

static PyObject *refkey_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != &RefKeyType || Py_TYPE(b) != &RefKeyType)
        Py_RETURN_NOTIMPLEMENTED;
    RefKey *x = (RefKey *)a, *y = (RefKey *)b;
    int eq = x->hash == y->hash && x->n[0] == y->n[0] && x->n[1] == y->n[1] && refkey_sizes_hold(x) &&
             refkey_sizes_hold(y);
    for (int i = 0; eq && i < 2; i++)
        eq = memcmp(refkey_items(x, i), refkey_items(y, i), (size_t)x->n[i] * sizeof(PyObject *)) == 0;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

/* pinned(): this key holding a reference to every entry (None if one is not an exact int). */
static PyObject *refkey_pinned(PyObject *self, PyObject *unused) {
    (void)unused;
    RefKey *k = (RefKey *)self;
    if (k->items != NULL) { Py_INCREF(self); return self; }
    if (!refkey_sizes_hold(k)) Py_RETURN_NONE;
    Py_ssize_t total = k->n[0] + k->n[1];
    for (int i = 0; i < 2; i++) {
        PyObject **it = refkey_items(k, i);
        for (Py_ssize_t j = 0; j < k->n[i]; j++)
            if (Py_TYPE(it[j]) != &PyLong_Type) Py_RETURN_NONE;
    }
    PyObject **items = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(PyObject *));
    if (items == NULL) return PyErr_NoMemory();
    memcpy(items, refkey_items(k, 0), (size_t)k->n[0] * sizeof(PyObject *));
    memcpy(items + k->n[0], refkey_items(k, 1), (size_t)k->n[1] * sizeof(PyObject *));
    for (Py_ssize_t i = 0; i < total; i++) Py_INCREF(items[i]);
    RefKey *p = PyObject_New(RefKey, &RefKeyType);
    if (p == NULL) {
        for (Py_ssize_t i = 0; i < total; i++) Py_DECREF(items[i]);
        PyMem_Free(items);
        return NULL;
    }
    p->hash = k->hash;
    p->n[0] = k->n[0];
    p->n[1] = k->n[1];
    p->seq[0] = p->seq[1] = NULL;
    p->items = items;
    return (PyObject *)p;
}

static PyMethodDef refkey_methods[] = {
    {"pinned", refkey_pinned, METH_NOARGS, "pinned() -> this key holding its entries, or None"},
    {NULL, NULL, 0, NULL},
};

static PyObject *refkey_repr(PyObject *self) {
    RefKey *k = (RefKey *)self;
    return PyUnicode_FromFormat("RefKey(%zd + %zd entries%s)", k->n[0], k->n[1], k->items ? ", pinned" : "");
}

static PyTypeObject RefKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "datadist.engine._native.RefKey",
    .tp_basicsize = sizeof(RefKey),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Two block lists as a hashable key by the identity of their entries (made by ref_key).",
    .tp_dealloc = refkey_dealloc,
    .tp_hash = refkey_hash,
    .tp_richcompare = refkey_richcompare,
    .tp_repr = refkey_repr,
    .tp_methods = refkey_methods,
};

/* One entry's share of a RefKey's hash: mixed on its own with its position, then added
 * (independent mixes: see int_key). */
static inline uint64_t refkey_mix(PyObject *entry, Py_ssize_t j, uint64_t salt) {
    uint64_t z = ((uint64_t)(uintptr_t)entry ^ ((uint64_t)j * 0x9E3779B97F4A7C15ull + salt)) * 0xBF58476D1CE4E5B9ull;
    return z ^ (z >> 29);
}

/* ref_key(a, b, limit): a probe RefKey of two lists or tuples of together at most limit
 * entries; None for anything else.  Hashes the entry pointers, never visits an entry. */
static PyObject *py_ref_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "ref_key(a, b, limit)"); return NULL; }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    for (int i = 0; i < 2; i++)
        if (!PyList_CheckExact(args[i]) && !PyTuple_CheckExact(args[i])) Py_RETURN_NONE;
    Py_ssize_t n0 = PySequence_Fast_GET_SIZE(args[0]), n1 = PySequence_Fast_GET_SIZE(args[1]);
    if (n0 + n1 > limit) Py_RETURN_NONE;
    RefKey *k = PyObject_New(RefKey, &RefKeyType);
    if (k == NULL) return NULL;
    k->n[0] = n0;
    k->n[1] = n1;
    k->items = NULL;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n0 ^ ((uint64_t)n1 << 32);
    for (int i = 0; i < 2; i++) {
        Py_INCREF(args[i]);
        k->seq[i] = args[i];
        PyObject **it = PySequence_Fast_ITEMS(args[i]);
        uint64_t salt = i ? 0xD6E8FEB86659FD93ull : 0;
        /* About 128 entries of each list are hashed (all of a short one, and the last):
         * equality compares every pointer anyway, so a key that shares the sampled ones
         * costs a memcmp that stops at the first difference, never a wrong match. */
        Py_ssize_t n = k->n[i], step = n > 128 ? n / 128 : 1;
        for (Py_ssize_t j = 0; j < n; j += step) h += refkey_mix(it[j], j, salt);
        if (n && (n - 1) % step) h += refkey_mix(it[n - 1], n - 1, salt);  /* the last, if skipped */
    }
    h = (h ^ (h >> 32)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    Py_hash_t hash = (Py_hash_t)h;
    k->hash = hash == -1 ? -2 : hash;
    return (PyObject *)k;
}

/* int_key(seq, limit): a list or tuple of at most limit exact ints as an IntKey; None for
 * any other type, for any entry that is not exactly an int (1.0 and True compare equal to
 * 1 but are not block indices), for one outside int64 and for more than limit entries. */
static PyObject *py_int_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "int_key(seq, limit)"); return NULL; }
    PyObject *seq = args[0];
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > limit) Py_RETURN_NONE;
    IntKey *key = PyObject_NewVar(IntKey, &IntKeyType, n);
    if (key == NULL) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* Each value is mixed with its position on its own and the mixes are added: no chain
     * of multiplies from one entry to the next, so the loop runs at the speed of the loads. */
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        if (dd_exact_int(items[i], &v) < 0) { Py_DECREF(key); Py_RETURN_NONE; }
        key->v[i] = v;
        uint64_t z = ((uint64_t)v ^ ((uint64_t)i * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
        h += z ^ (z >> 29);
    }
    h = (h ^ (h >> 32)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    Py_hash_t hash = (Py_hash_t)h;
    key->hash = hash == -1 ? -2 : hash;  /* -1 means "error" to a tp_hash */
    return (PyObject *)key;
}

/* Whether the stream on fd has ended (peer closed or reset) without blocking: one poll
 * with a zero timeout and, if readable, a one-byte peek.  Pending data is not an end. */
static PyObject *py_peer_closed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "peer_closed(fd)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    struct pollfd p = {.fd = (int)fd, .events = POLLIN | POLLRDHUP, .revents = 0};
    int r = poll(&p, 1, 0);
    if (r <= 0) Py_RETURN_FALSE;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL | POLLRDHUP)) Py_RETURN_TRUE;
    char c;
    ssize_t n = recv((int)fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* How far the next frame on a socket has arrived, without reading it, in two non-blocking
 * system calls (a peek at the header, the count of bytes queued) and without giving up the
 * GIL: this runs before every request a busy agent or pool worker serves.  -1 when nothing
 * has arrived, 0 while part of a frame of at most whole_max bytes has, 1 once it is whole,
 * at the end of the stream and on an error (the read that follows meets them), 2 for a
 * frame larger than whole_max whose header is in.  A frame's size is the codec's 16-byte
 * header plus the body and array lengths it holds (little-endian u32 at bytes 8 and 12). */
static PyObject *py_frame_arrived(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "frame_arrived(fd, whole_max)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    long long whole_max = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    uint8_t head[16];
    long state;
    ssize_t n = recv((int)fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0)
        state = errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1 : 1;
    else if (n == 0)
        state = 1;
    else if (n < (ssize_t)sizeof head)
        state = 0;
    else {
        uint64_t size = sizeof head;
        for (int f = 8; f < 16; f += 4)
            size += (uint64_t)head[f] | (uint64_t)head[f + 1] << 8 | (uint64_t)head[f + 2] << 16
                  | (uint64_t)head[f + 3] << 24;
        int queued = 0;
        if (size > (uint64_t)whole_max)
            state = 2;
        else if (size == sizeof head || ioctl((int)fd, FIONREAD, &queued) < 0)
            state = 1;
        else
            state = (uint64_t)queued >= size;
    }
    return PyLong_FromLong(state);
}

/* ---------------------------------------------------------------- transfer counts */

/* The latency histogram's upper bounds in nanoseconds, set once by meter_bounds. */
#define DD_MAX_BOUNDS 64
static int64_t meter_bounds_ns[DD_MAX_BOUNDS];
static Py_ssize_t meter_nbounds = -1;

/* meter_bounds(bounds): the histogram's bucket bounds (an int64 buffer of nanoseconds,
 * ascending, at most 64) for every later meter_moved. */
static PyObject *py_meter_bounds(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "meter_bounds(bounds)");
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = v.len / 8;
    int ok = v.len % 8 == 0 && n <= DD_MAX_BOUNDS;
    for (Py_ssize_t i = 1; ok && i < n; i++) ok = ((const int64_t *)v.buf)[i - 1] < ((const int64_t *)v.buf)[i];
    if (ok) {
        memcpy(meter_bounds_ns, v.buf, (size_t)v.len);
        meter_nbounds = n;
    }
    PyBuffer_Release(&v);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "meter_bounds: at most 64 ascending int64 nanoseconds");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* meter_moved(cells, nbytes, start): count one transfer of nbytes that began at start
 * (seconds of CLOCK_MONOTONIC, time.monotonic's clock) in cells, an int64 buffer of
 * [bytes, nanoseconds, bucket 0 .. bucket B] (B: the bounds of meter_bounds): the bytes,
 * the latency, and one in the first bucket whose bound the latency does not exceed (the
 * last one past every bound).  Under the GIL: a reader holding it sees whole counts. */
static PyObject *py_meter_moved(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "meter_moved(cells, nbytes, start)");
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    double start = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return NULL;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec - (int64_t)(start * 1e9);
    if (ns < 0) ns = 0;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (meter_nbounds < 0 || v.len != (Py_ssize_t)(8 * (meter_nbounds + 3))) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "meter_moved: cells must be int64 [bytes, ns, buckets] of meter_bounds");
        return NULL;
    }
    int64_t *c = (int64_t *)v.buf;
    Py_ssize_t b = 0;
    while (b < meter_nbounds && ns > meter_bounds_ns[b]) b++;
    c[0] += nbytes;
    c[1] += ns;
    c[2 + b] += 1;
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"meter_bounds", (PyCFunction)(void (*)(void))py_meter_bounds, METH_FASTCALL,
     "meter_bounds(bounds) -> None: the latency histogram's bounds (int64 ns) for meter_moved"},
    {"meter_moved", (PyCFunction)(void (*)(void))py_meter_moved, METH_FASTCALL,
     "meter_moved(cells, nbytes, start) -> None: count one transfer into int64 cells [bytes, ns, buckets]"},
    {"peer_closed", (PyCFunction)(void (*)(void))py_peer_closed, METH_FASTCALL,
     "peer_closed(fd) -> whether the stream has ended (no wait)"},
    {"moves_now", (PyCFunction)(void (*)(void))py_moves_now, METH_FASTCALL,
     "moves_now(fd, push, need) -> whether a push's need bytes have arrived, or a pull's fit the free send buffer"},
    {"frame_arrived", (PyCFunction)(void (*)(void))py_frame_arrived, METH_FASTCALL,
     "frame_arrived(fd, whole_max) -> how far the next frame has arrived (peeked): -1 nothing, 0 part, 1 whole, 2 over whole_max"},
    {"spin_readable", (PyCFunction)(void (*)(void))py_spin_readable, METH_FASTCALL,
     "spin_readable(fd, spin_us) -> whether fd became readable within spin_us (polled without sleeping)"},
    {"request", (PyCFunction)(void (*)(void))py_request, METH_FASTCALL,
     "request(fd, head, base, off, len, answer_len, spin_us, timeout_ms) -> the answer's first answer_len bytes"},
    {"serve_known", (PyCFunction)(void (*)(void))py_serve_known, METH_FASTCALL,
     "serve_known(fd, known, epoch, header_size, limit, timeout_ms, answer, defer) -> (0, admitted) served | "
     "(1, header) | (2, frame) read, not served"},
    {"half_extent", (PyCFunction)(void (*)(void))py_half_extent, METH_FASTCALL,
     "half_extent(bases, offs, lens) -> (total, end) of a peer's plan half, or None if out of bounds"},
    {"coalesce", (PyCFunction)(void (*)(void))py_coalesce, METH_FASTCALL,
     "coalesce(src, dst, lens) -> the runs with neighbours that continue each other merged (uint64 bytearrays)"},
    {"ref_key", (PyCFunction)(void (*)(void))py_ref_key, METH_FASTCALL,
     "ref_key(a, b, limit) -> a RefKey of two lists or tuples by the identity of their entries; None otherwise"},
    {"int_key", (PyCFunction)(void (*)(void))py_int_key, METH_FASTCALL,
     "int_key(seq, limit) -> a list or tuple of exact ints as a hashable IntKey; None otherwise or if longer than limit"},
    {"index_array", (PyCFunction)(void (*)(void))py_index_array, METH_FASTCALL,
     "index_array(seq) -> (int64 bytes, min, max) of a list or tuple of ints; None for other types"},
    {"recv_exact", (PyCFunction)(void (*)(void))py_recv_exact, METH_FASTCALL,
     "recv_exact(fd, buffer, timeout_ms) -> bytes read (OSError on timeout or end of stream)"},
    {"wait_readable", (PyCFunction)(void (*)(void))py_wait_readable, METH_FASTCALL,
     "wait_readable(fd, spin_us, timeout_ms) -> 0 (OSError ETIMEDOUT at the deadline)"},
    {"copy_plan", (PyCFunction)(void (*)(void))py_copy_plan, METH_FASTCALL,
     "copy_plan(sbase, dbase, soff, doff, len, threads) -> bytes copied"},
    {"sum_blocks", (PyCFunction)(void (*)(void))py_sum_blocks, METH_FASTCALL,
     "sum_blocks(value, sums): add the two sums of each whole 4 KiB block of value to sums"},
    {"sum_stream", (PyCFunction)(void (*)(void))py_sum_stream, METH_FASTCALL,
     "sum_stream(data, sums, pos, tail, tail_start): add data, the stream's bytes from pos, to its block sums"},
    {"copy_plan_stream", (PyCFunction)(void (*)(void))py_copy_plan_stream, METH_FASTCALL,
     "copy_plan_stream(sbase, dbase, soff, doff, len, threads, sums, pos, tail, tail_start) -> bytes copied; "
     "copies a plan summing its stream"},
    {"sum_plan", (PyCFunction)(void (*)(void))py_sum_plan, METH_FASTCALL,
     "sum_plan(base, off, len, sums, pos, tail, tail_start) -> bytes; sums a plan half's runs in plan order"},
    {"copy_plan_sum", (PyCFunction)(void (*)(void))py_copy_plan_sum, METH_FASTCALL,
     "copy_plan_sum(sbase, dbase, soff, doff, len, threads, sums, value_base, value_is_src) -> bytes copied; "
     "adds the copied bytes into the value's 4 KiB block sums (OSError ERANGE if a run leaves the value)"},
    {"call_plan", (PyCFunction)(void (*)(void))py_call_plan, METH_FASTCALL,
     "call_plan(fn, stream, sbase, dbase, soff, doff, len) -> (bytes issued, status): calls "
     "int fn(dst, src, bytes, stream) per run until one returns non-zero"},
    {"cma_plan", (PyCFunction)(void (*)(void))py_cma_plan, METH_FASTCALL,
     "cma_plan(pid, write, lbase, rbase, loff, roff, len) -> bytes moved (OSError on failure)"},
    {"sock_summed", (PyCFunction)(void (*)(void))py_sock_summed, METH_FASTCALL,
     "sock_summed(fd, send, timeout_ms, base, off, len[, head]) -> checksum | (got, sent)"},
    {"sock_plan", (PyCFunction)(void (*)(void))py_sock_plan, METH_FASTCALL,
     "sock_plan(fd, send, timeout_ms, base, off, len[, head]) -> payload bytes moved (OSError on failure)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "Executors of datadist copy plans.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyTypeObject *types[] = {&IntKeyType, &RefKeyType};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyModule_AddType(m, types[i]) < 0) {  /* readies the type, and adds a reference */
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "FAST_SUMMED_MAX", DD_FAST_SUMMED_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
