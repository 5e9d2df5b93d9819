/*
 * The agent's fast path (serve_known): a transfer request that repeats one checked and
 * admitted before is read, recognized and served without the GIL.
 */
#include "native.h"

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

PyMethodDef dd_serve_methods[] = {
    {"serve_known", (PyCFunction)(void (*)(void))py_serve_known, METH_FASTCALL,
     "serve_known(fd, known, epoch, header_size, limit, timeout_ms, answer, defer) -> (0, admitted) served | "
     "(1, header) | (2, frame) read, not served"},
    {NULL, NULL, 0, NULL},
};
