/*
 * Executors of a plan's copies in this process: memory to memory (streaming stores for
 * copies beyond the cache, byte ranges shared among threads, an optional deadline), the
 * same copy summing what it copies (the block sums of checksum.py), a copy function of a
 * device runtime called per run, and cross-memory attach to another process.  Plain C,
 * called without the GIL; errors are negative errno values.
 */
#include "native.h"

/* Copies at least this large use streaming stores (x86): their destination would not
 * stay in the cache anyway, and skipping its read-for-ownership saves a third of the
 * memory traffic (figures before and after: docs/benchmarks.md). */
#define DD_STREAM_MIN_BYTES (4u << 20)

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
void copy_sum(uint8_t *d, const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums, int stream) {
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

static void run_parts(part_t *parts, int n) { run_threads(copy_thread, parts, sizeof(part_t), n); }

/* Copy every run (a = source, b = destination); destinations must not overlap.  The plan
 * is split by bytes (4 KiB aligned chunks), not by runs, so one huge run is shared too.
 * With a deadline (ms since the monotonic epoch, 0: none) no chunk starts after it, and
 * an unfinished copy returns -ETIMEDOUT (its destination bytes are then undefined). */
int64_t dd_copy_plan(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
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
int64_t dd_copy_plan_sum(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
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

/* Call fn once per non-empty run, in plan order; stops at the first failure.  Returns the
 * bytes of the runs issued and stores fn's status (0, or the failing call's code). */
uint64_t dd_call_plan(run_fn fn, void *stream, size_t nt, const uint64_t *sbase, const uint64_t *dbase,
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

/* One-sided copy between this process (a side) and process `pid` (b side): write=1 moves
 * a -> b with process_vm_writev, write=0 moves b -> a with process_vm_readv.  Returns
 * bytes moved or -errno (ESRCH: peer gone, EFAULT: an address outside the peer's
 * mappings, EPERM: no ptrace access). */
int64_t dd_cma_plan(int pid, int write, size_t nt, const uint64_t *lbase, const uint64_t *rbase,
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
