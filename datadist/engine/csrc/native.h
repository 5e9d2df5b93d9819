/*
 * What the files of the datadist.engine._native extension share.
 *
 * A plan is factored: T base address pairs (one per tensor) crossed with U runs (source
 * offset, destination offset, length), i.e. run (t, u) copies len[u] bytes from
 * sbase[t] + soff[u] to dbase[t] + doff[u], tensor-major.  Keeping it factored makes plans
 * O(T + U) to build and to send.  The executors (plan.c, copy.c, sums.c, sockio.c) are
 * plain C that runs a whole plan without the GIL and with as few system calls as the
 * kernel allows; errors are negative errno values, which the Python side maps to the
 * contract's exceptions.  The module's functions (py_plans.c, py_sockets.c, serve.c,
 * keys.c, meter.c; module.c makes the module) take buffer objects (numpy arrays) and drop
 * the GIL while the executors run, so a call costs well under a microsecond of Python
 * overhead.  Everything here is internal to the extension (built with hidden visibility).
 */
#ifndef DD_NATIVE_H
#define DD_NATIVE_H

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

/* The most threads one plan's copy or sums are shared among. */
#define DD_MAX_THREADS 8

static inline int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------- plans (plan.c) */

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

static inline int cursor_end(const plan_t *p, const cursor_t *c) { return c->t >= p->nt; }
void cursor_skip_empty(const plan_t *p, cursor_t *c);
void cursor_advance(const plan_t *p, cursor_t *c, uint64_t bytes);
size_t fill_iov(const plan_t *p, const cursor_t *c, struct iovec *a, struct iovec *b, uint64_t *bytes, size_t max);
uint64_t plan_bytes(const plan_t *p);

/* The threads of one big copy take byte ranges of the plan's concatenated stream in
 * chunks from a shared counter, not a fixed share each: on a busy machine a thread that
 * loses its core would otherwise hold the whole copy up while the others sit idle. */
typedef struct {
    uint64_t total, chunk;
    uint64_t next;       /* next chunk index (atomic) */
    int64_t deadline_ms; /* no chunk starts after it (0: none); see `expired` */
    int expired;         /* set (atomic) when a chunk was left undone for the deadline */
} chunks_t;


chunks_t chunks_for(uint64_t total, int parts, int64_t deadline_ms);
int next_chunk(chunks_t *w, uint64_t *lo, uint64_t *hi);
int parts_for(int max_threads, uint64_t total);
void run_threads(void *(*fn)(void *), void *parts, size_t size, int n);

/* Visit the runs of bytes [lo, hi) of the plan's concatenated stream (each tensor's runs
 * in order, tensor after tensor): visit(ctx, t, u, a, from, to) for the bytes from..to of
 * run u of tensor t, which starts at stream offset a.  The one walk of a stream range that
 * copies, sums and gathers share. */
typedef void (*run_visit)(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to);
/* Inline: each walk then calls its visitor directly, not through a pointer per run. */
static inline void walk_stream(const plan_t *p, uint64_t lo, uint64_t hi, run_visit visit, void *ctx) {
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

/* ---------------------------------------------------------------- copies (copy.c) */

void copy_sum(uint8_t *d, const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums, int stream);
int64_t dd_copy_plan(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu, const uint64_t *soff,
                     const uint64_t *doff, const uint64_t *len, int max_threads, int64_t deadline_ms);
int64_t dd_copy_plan_sum(size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu, const uint64_t *soff,
                         const uint64_t *doff, const uint64_t *len, int max_threads, int by_stream, int value_is_src,
                         uint64_t vbase, uint64_t *sums, size_t nblocks);

/* A copy function of the shape of CUDA's cuMemcpyAsync(dst, src, bytes, stream): returns
 * 0 on success, an error code otherwise.  Taken by address, so this file needs no header
 * or library of the runtime that provides it. */
typedef int (*run_fn)(uint64_t dst, uint64_t src, size_t n, void *stream);
uint64_t dd_call_plan(run_fn fn, void *stream, size_t nt, const uint64_t *sbase, const uint64_t *dbase, size_t nu,
                      const uint64_t *soff, const uint64_t *doff, const uint64_t *len, int *status);
int64_t dd_cma_plan(int pid, int write, size_t nt, const uint64_t *lbase, const uint64_t *rbase, size_t nu,
                    const uint64_t *loff, const uint64_t *roff, const uint64_t *len, int64_t deadline_ms);

/* ---------------------------------------------------------------- block sums (sums.c) */

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

int summer_fits(const summer_t *m, uint64_t n);
void sum_piece(summer_t *m, const uint8_t *s, uint64_t n);
void dd_sum_blocks(const uint8_t *s, uint64_t n, uint64_t *sums);
void gather_stream(const plan_t *p, uint64_t lo, uint8_t *out);
void dd_sum_plan(summer_t *m, const plan_t *p, int max_threads);
uint64_t summer_checksum(const summer_t *m, uint64_t n);
summer_t summer_alloc(uint64_t n);
void summer_free(summer_t *m);

/* ---------------------------------------------------------------- sockets (sockio.c) */

/* The largest summed transfer serve_known serves (its block sums are allocated per request;
 * larger ones cost their Python path's overhead relatively little). */
#ifndef DD_FAST_SUMMED_MAX
#define DD_FAST_SUMMED_MAX (4u << 20)
#endif

int64_t sock_io(int fd, int send, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len, char *trail,
                size_t trail_len, summer_t *m);
int64_t dd_spin_readable(int fd, int64_t spin_us);
int64_t dd_wait_readable(int fd, int64_t spin_us, int64_t timeout_ms);
int64_t dd_recv_exact(int fd, void *buf, uint64_t len, int64_t timeout_ms);
void put_le64(uint8_t *t, uint64_t v);
int64_t send_summed(int fd, int64_t timeout_ms, const plan_t *p, const char *head, size_t head_len, summer_t *m,
                    uint64_t n, uint64_t *sum);
int64_t recv_summed(int fd, int64_t timeout_ms, const plan_t *p, summer_t *m, uint64_t n, uint64_t *got,
                    uint64_t *sent);
int moves_now(int fd, int push, uint64_t need);

/* ---------------------------------------------------------------- arguments (args.c) */

/* A plan's arrays borrowed from their buffers by get_plan (release with release_plan). */
typedef struct {
    Py_buffer v[5];
    int held;
    size_t nt, nu;
} plan_args;

#define U64P(a, i) ((const uint64_t *)(a).v[i].buf)

int get_plan(PyObject *const *objs, int nobj, plan_args *a);
void release_plan(plan_args *a);
plan_t half_plan(const plan_args *a);
uint64_t half_bytes(const plan_args *a);
PyObject *result_or_oserror(int64_t r);
int deadline_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, int64_t *deadline);
int get_summer(PyObject *const *args, summer_t *m, Py_buffer *views);
void release_summer(Py_buffer *views);

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

/* ---------------------------------------------------------------- the module's parts */

extern PyMethodDef dd_plan_methods[], dd_socket_methods[], dd_serve_methods[], dd_key_methods[], dd_meter_methods[];
int dd_add_key_types(PyObject *m);

#endif
