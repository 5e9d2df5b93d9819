/*
 * A plan's runs through a non-blocking socket: writev/readv in as few system calls as the
 * kernel allows, with a frame head before and a trailer after them in the same calls,
 * summed right after each call when asked (a summed stream and its checksum trailer), a
 * deadline on the whole, and the waits for a readable socket (a short spin first).
 */
#include "native.h"

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

/* Stream the a side of a plan through a socket with writev/readv (send=1 writes the runs,
 * after `head` and before `trail` if given, in the same system calls; send=0 reads into
 * the runs, then `trail`), for at most timeout_ms.  With a summer `m` the payload's bytes
 * are added to its block sums right after each system call moved them (still in the
 * cache): a checksum of what was sent or received, at no pass of its own over memory.
 * The descriptor must be non-blocking (Python sockets with a timeout are).  Returns the
 * run bytes moved, -ETIMEDOUT, -ECONNRESET at end of stream, or -errno. */
int64_t sock_io(int fd, int send, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len,
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
int64_t dd_spin_readable(int fd, int64_t spin_us) {
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

int64_t dd_wait_readable(int fd, int64_t spin_us, int64_t timeout_ms) {
    if (spin_us > 0) { /* no spin: the sleeping poll alone (a spin's first poll would be a system call more) */
        int64_t r = dd_spin_readable(fd, spin_us);
        if (r != 0) return r < 0 ? r : 0;
    }
    return wait_fd(fd, POLLIN, now_ms() + timeout_ms);
}

/* Fill buf (len bytes) from a non-blocking socket within timeout_ms: bytes read, or -errno. */
int64_t dd_recv_exact(int fd, void *buf, uint64_t len, int64_t timeout_ms) {
    uint64_t addr = (uint64_t)(uintptr_t)buf, zero = 0;
    plan_t p = {&addr, &addr, &zero, &zero, &len, 1, 1};
    return len ? sock_io(fd, 0, timeout_ms, &p, NULL, 0, NULL, 0, NULL) : 0;
}

void put_le64(uint8_t *t, uint64_t v) {
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
int64_t send_summed(int fd, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len,
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
int64_t recv_summed(int fd, int64_t timeout_ms, const plan_t *p, summer_t *m, uint64_t n, uint64_t *got,
                           uint64_t *sent) {
    uint8_t t[8];
    int64_t r = sock_io(fd, 0, timeout_ms, p, NULL, 0, (char *)t, 8, m);
    if (r < 0) return r;
    *got = summer_checksum(m, n);
    *sent = get_le64(t);
    return r;
}

/* Whether a transfer's bytes move now, without waiting for the peer: a push's need bytes
 * (payload and checksum) are all in the socket's receive buffer; a pull's (answer, payload
 * and checksum) fit what its send buffer has free, taken as half of SO_SNDBUF, which the
 * kernel counts with its own overhead.  Two non-blocking system calls. */
int moves_now(int fd, int push, uint64_t need) {
    int n = 0, sndbuf = 0;
    socklen_t len = sizeof sndbuf;
    if (push) return ioctl(fd, FIONREAD, &n) == 0 && (uint64_t)n >= need;
    return ioctl(fd, SIOCOUTQ, &n) == 0 && getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) == 0 &&
           (uint64_t)n + need <= (uint64_t)sndbuf / 2;
}
