/*
 * Arguments of the module's functions: plan arrays (numpy uint64 buffers) borrowed without a
 * copy, summers over caller-owned sums and tail buffers, deadlines, and errno results as
 * OSError.
 */
#include "native.h"

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

void release_plan(plan_args *a) {
    for (int i = 0; i < a->held; i++) PyBuffer_Release(&a->v[i]);
    a->held = 0;
}

/* objs: base A, base B, off A, off B, len (B may be NULL: single-sided) */
int get_plan(PyObject *const *objs, int nobj, plan_args *a) {
    size_t counts[5] = {0};
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

/* A plan half held by get_plan (base, off, len) as a plan whose two sides are that half;
 * an empty plan when none is held. */
plan_t half_plan(const plan_args *a) {
    if (a->held < 3) return (plan_t){0};
    return (plan_t){U64P(*a, 0), U64P(*a, 0), U64P(*a, 1), U64P(*a, 1), U64P(*a, 2), a->nt, a->nu};
}

/* Bytes a plan half held by get_plan moves; 0 when none is held. */
uint64_t half_bytes(const plan_args *a) {
    plan_t p = half_plan(a);
    return plan_bytes(&p);
}

PyObject *result_or_oserror(int64_t r) {
    if (r < 0) {
        errno = (int)-r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(r);
}

/* The optional trailing timeout argument (ms, 0 or absent: none) as a deadline. */
int deadline_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, int64_t *deadline) {
    *deadline = 0;
    if (nargs <= i) return 0;
    long long ms = PyLong_AsLongLong(args[i]);
    if (ms == -1 && PyErr_Occurred()) return -1;
    if (ms > 0) *deadline = now_ms() + ms;
    return 0;
}

/* A summer from (sums, pos, tail, tail_start): its buffers held in views[0..1] (release
 * with release_summer); tail None: no tail.  -1 with an exception set on bad arguments. */
int get_summer(PyObject *const *args, summer_t *m, Py_buffer *views) {
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

void release_summer(Py_buffer *views) {
    PyBuffer_Release(&views[0]);
    if (views[1].buf) PyBuffer_Release(&views[1]);
}
