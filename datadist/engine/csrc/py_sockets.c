/*
 * The module's socket functions: a plan's runs through a socket (plain or summed), a
 * link's request and its answer in one call, the waits for a readable socket, and the
 * non-blocking looks at a socket the agent takes before serving it (has the peer closed,
 * how far has the next frame arrived, would a transfer's bytes move now).
 */
#include "native.h"

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

static PyObject *py_moves_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "moves_now(fd, push, need)"); return NULL; }
    long fd = PyLong_AsLong(args[0]);
    int push = PyObject_IsTrue(args[1]);
    unsigned long long need = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(moves_now((int)fd, push, need));
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

PyMethodDef dd_socket_methods[] = {
    {"sock_plan", (PyCFunction)(void (*)(void))py_sock_plan, METH_FASTCALL,
     "sock_plan(fd, send, timeout_ms, base, off, len[, head]) -> payload bytes moved (OSError on failure)"},
    {"sock_summed", (PyCFunction)(void (*)(void))py_sock_summed, METH_FASTCALL,
     "sock_summed(fd, send, timeout_ms, base, off, len[, head]) -> checksum | (got, sent)"},
    {"wait_readable", (PyCFunction)(void (*)(void))py_wait_readable, METH_FASTCALL,
     "wait_readable(fd, spin_us, timeout_ms) -> 0 (OSError ETIMEDOUT at the deadline)"},
    {"recv_exact", (PyCFunction)(void (*)(void))py_recv_exact, METH_FASTCALL,
     "recv_exact(fd, buffer, timeout_ms) -> bytes read (OSError on timeout or end of stream)"},
    {"request", (PyCFunction)(void (*)(void))py_request, METH_FASTCALL,
     "request(fd, head, base, off, len, answer_len, spin_us, timeout_ms) -> the answer's first answer_len bytes"},
    {"moves_now", (PyCFunction)(void (*)(void))py_moves_now, METH_FASTCALL,
     "moves_now(fd, push, need) -> whether a push's need bytes have arrived, or a pull's fit the free send buffer"},
    {"spin_readable", (PyCFunction)(void (*)(void))py_spin_readable, METH_FASTCALL,
     "spin_readable(fd, spin_us) -> whether fd became readable within spin_us (polled without sleeping)"},
    {"peer_closed", (PyCFunction)(void (*)(void))py_peer_closed, METH_FASTCALL,
     "peer_closed(fd) -> whether the stream has ended (no wait)"},
    {"frame_arrived", (PyCFunction)(void (*)(void))py_frame_arrived, METH_FASTCALL,
     "frame_arrived(fd, whole_max) -> how far the next frame has arrived (peeked): -1 nothing, 0 part, 1 whole, 2 over whole_max"},
    {NULL, NULL, 0, NULL},
};
