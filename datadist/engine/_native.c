/*
 * Executors for coalesced copy plans.  A plan is factored: T base address pairs (one per
 * tensor) crossed with U runs (source offset, destination offset, length), i.e. run
 * (t, u) copies len[u] bytes from sbase[t] + soff[u] to dbase[t] + doff[u], tensor-major.
 * Keeping it factored makes plans O(T + U) to build and to send.  These run a whole plan with
 * the GIL released (they are called through ctypes) and with as few system calls as the
 * kernel allows.  Errors are returned as negative errno values; the Python side maps them
 * to the contract's exceptions.  No Python C API is used on purpose: the file is a plain
 * shared object that ctypes loads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* Stay below IOV_MAX (1024) so that one batch is always one system call. */
#define DD_IOV_BATCH 1024

/* Plans larger than this are split over two threads: one core rarely saturates memory
 * bandwidth on its own, and the second copy runs while the first waits on DRAM. */
#define DD_PARALLEL_MIN_BYTES (8u << 20)
#define DD_MAX_THREADS 8

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

/* Fill up to DD_IOV_BATCH iovecs from the cursor without moving it; returns the count. */
static size_t fill_iov(const plan_t *p, const cursor_t *c, struct iovec *a, struct iovec *b,
                       uint64_t *bytes) {
    size_t k = 0, t = c->t, u = c->u;
    uint64_t done = c->done;
    *bytes = 0;
    while (t < p->nt && k < DD_IOV_BATCH) {
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

typedef struct {
    const plan_t *p;
    uint64_t lo, hi; /* this part copies bytes [lo, hi) of the plan's concatenated stream */
} copy_part;

static void copy_range(const copy_part *cp) {
    const plan_t *p = cp->p;
    uint64_t per_t = 0;
    for (size_t u = 0; u < p->nu; u++) per_t += p->len[u];
    if (per_t == 0) return;
    for (size_t t = cp->lo / per_t; t < p->nt; t++) {
        uint64_t pos = t * per_t;
        if (pos >= cp->hi) return;
        for (size_t u = 0; u < p->nu && pos < cp->hi; u++) {
            uint64_t a = pos, b = pos + p->len[u];
            pos = b;
            if (b <= cp->lo) continue;
            uint64_t s = a < cp->lo ? cp->lo - a : 0;
            uint64_t e = (b > cp->hi ? cp->hi : b) - a;
            memmove((void *)(uintptr_t)(p->b_base[t] + p->b_off[u] + s),
                    (const void *)(uintptr_t)(p->a_base[t] + p->a_off[u] + s), e - s);
        }
    }
}

static void *copy_thread(void *arg) {
    copy_range((const copy_part *)arg);
    return NULL;
}

/* Copy every run (a = source, b = destination); destinations must not overlap.  The plan
 * is split by bytes (4 KiB aligned), not by runs, so one huge run is shared too. */
int64_t dd_copy_plan(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
                     const uint64_t *soff, const uint64_t *doff, const uint64_t *len,
                     int max_threads) {
    plan_t p = {sbase, dbase, soff, doff, len, nt, nu};
    uint64_t per_t = 0;
    for (size_t u = 0; u < nu; u++) per_t += len[u];
    uint64_t total = per_t * nt;
    int parts = max_threads < 1 ? 1 : (max_threads > DD_MAX_THREADS ? DD_MAX_THREADS : max_threads);
    if (total < DD_PARALLEL_MIN_BYTES) parts = 1;
    copy_part cp[DD_MAX_THREADS];
    pthread_t th[DD_MAX_THREADS];
    int started[DD_MAX_THREADS] = {0};
    uint64_t share = ((total / parts) + 4095) & ~(uint64_t)4095;
    for (int k = 0; k < parts; k++) {
        uint64_t lo = share * k, hi = k == parts - 1 ? total : share * (k + 1);
        cp[k] = (copy_part){&p, lo > total ? total : lo, hi > total ? total : hi};
    }
    for (int k = 1; k < parts; k++)
        started[k] = pthread_create(&th[k], NULL, copy_thread, &cp[k]) == 0;
    copy_range(&cp[0]);
    for (int k = 1; k < parts; k++) {
        if (started[k]) pthread_join(th[k], NULL);
        else copy_range(&cp[k]); /* no thread to spare: do it here */
    }
    return (int64_t)total;
}

/* ---------------------------------------------------------------- cross-memory attach */

/* One-sided copy between this process (a side) and process `pid` (b side): write=1 moves
 * a -> b with process_vm_writev, write=0 moves b -> a with process_vm_readv.  Returns
 * bytes moved or -errno (ESRCH: peer gone, EFAULT: an address outside the peer's
 * mappings, EPERM: no ptrace access). */
int64_t dd_cma_plan(int pid, int write, size_t nt, const uint64_t *lbase, const uint64_t *rbase,
                    size_t nu, const uint64_t *loff, const uint64_t *roff, const uint64_t *len) {
    plan_t p = {lbase, rbase, loff, roff, len, nt, nu};
    struct iovec liov[DD_IOV_BATCH], riov[DD_IOV_BATCH];
    cursor_t c = {0, 0, 0};
    int64_t moved = 0;
    cursor_skip_empty(&p, &c);
    while (!cursor_end(&p, &c)) {
        uint64_t want;
        size_t k = fill_iov(&p, &c, liov, riov, &want);
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

/* Stream the a side of a plan through a socket with writev/readv (send=1 writes the runs,
 * send=0 reads into them), for at most timeout_ms.  The descriptor must be non-blocking
 * (Python sockets with a timeout are).  Returns bytes moved, -ETIMEDOUT, -ECONNRESET at
 * end of stream, or -errno. */
int64_t dd_sock_plan(int fd, int send, int64_t timeout_ms, size_t nt, const uint64_t *base,
                     size_t nu, const uint64_t *off, const uint64_t *len) {
    plan_t p = {base, base, off, off, len, nt, nu};
    int64_t deadline = now_ms() + timeout_ms;
    struct iovec iov[DD_IOV_BATCH];
    cursor_t c = {0, 0, 0};
    int64_t moved = 0;
    cursor_skip_empty(&p, &c);
    while (!cursor_end(&p, &c)) {
        uint64_t want;
        size_t k = fill_iov(&p, &c, iov, NULL, &want);
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
        moved += r;
        cursor_advance(&p, &c, (uint64_t)r);
    }
    return moved;
}
