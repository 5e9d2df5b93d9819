/*
 * Transfer counts: bytes, latency and a latency histogram per transfer, added into a
 * caller's int64 cells under the GIL (what the engine's metrics read).
 */
#include "native.h"

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

PyMethodDef dd_meter_methods[] = {
    {"meter_bounds", (PyCFunction)(void (*)(void))py_meter_bounds, METH_FASTCALL,
     "meter_bounds(bounds) -> None: the latency histogram's bounds (int64 ns) for meter_moved"},
    {"meter_moved", (PyCFunction)(void (*)(void))py_meter_moved, METH_FASTCALL,
     "meter_moved(cells, nbytes, start) -> None: count one transfer into int64 cells [bytes, ns, buckets]"},
    {NULL, NULL, 0, NULL},
};
