/*
 * The module's plan functions: local copies (plain, summed, by a device runtime's copy
 * function, across processes), sums of plans and streams, and the one-pass helpers that
 * build and check plans (index arrays, coalescing runs, the extent of a peer's plan half).
 */
#include "native.h"

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

PyMethodDef dd_plan_methods[] = {
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
    {"index_array", (PyCFunction)(void (*)(void))py_index_array, METH_FASTCALL,
     "index_array(seq) -> (int64 bytes, min, max) of a list or tuple of ints; None for other types"},
    {"half_extent", (PyCFunction)(void (*)(void))py_half_extent, METH_FASTCALL,
     "half_extent(bases, offs, lens) -> (total, end) of a peer's plan half, or None if out of bounds"},
    {"coalesce", (PyCFunction)(void (*)(void))py_coalesce, METH_FASTCALL,
     "coalesce(src, dst, lens) -> the runs with neighbours that continue each other merged (uint64 bytearrays)"},
    {NULL, NULL, 0, NULL},
};
