/*
 * A set of keys published in shared memory: the daemon writes it, clients read it without
 * a round trip (``exists`` answered by a few cache misses instead of two context switches).
 *
 * Layout (all little-endian uint64, the buffer is a memfd both sides map):
 *   word 0  magic          KS_MAGIC once initialised
 *   word 1  seq            even: stable; odd: a rebuild is moving slots (readers retry)
 *   word 2  nslots         a power of two; slots follow the header
 *   word 3  live           keys present
 *   word 4  used           live + tombstones (the writer rebuilds past 3/4 of nslots)
 *   word 5  valid          1 while readers may trust the table, 0 makes them ask the daemon
 *   words 6..7 reserved
 *   slots   fingerprint of a key (>= 2), KS_EMPTY or KS_TOMB; linear probing
 *
 * One writer (the daemon, under its store lock); any number of readers in other processes.
 * Single inserts and removals never move a key, so a reader racing them sees the key either
 * present or absent; only a rebuild moves keys, and it runs inside an odd seq.  A key is
 * its 64-bit fingerprint: a false "present" needs a 64-bit collision within one tenant.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KS_MAGIC 0x3154455359454b45ULL /* "EKEYSET1" */
#define KS_HDR 8
#define KS_EMPTY 0ULL
#define KS_TOMB 1ULL
#define KS_READ_TRIES 4
/* The longest int-hash key count_ints builds on the stack (prefix + 16 hex + suffix). */
#define KS_KEY_MAX 1024

enum { H_MAGIC, H_SEQ, H_NSLOTS, H_LIVE, H_USED, H_VALID };

static inline uint64_t ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void st(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 30; h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27; h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

/* Fingerprint of a key's bytes: 8 bytes per step, the length folded in, never EMPTY/TOMB. */
static uint64_t fingerprint(const unsigned char *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)n * 0xff51afd7ed558ccdULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 32;
        p += 8; n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h = mix(h ^ w ^ ((uint64_t)n << 59));
    return h < 2 ? h + 2 : h;
}

/* Table checks shared by readers and the writer: NULL (and a Python error) if the buffer
 * is not an initialised table of its own size. */
static uint64_t *table_of(Py_buffer *b, uint64_t *mask_out) {
    if (b->len < (Py_ssize_t)(KS_HDR * 8)) { PyErr_SetString(PyExc_ValueError, "key set buffer too small"); return NULL; }
    uint64_t *t = (uint64_t *)b->buf;
    uint64_t n = ld(&t[H_NSLOTS]);
    /* n against the slots the buffer holds, by division: (KS_HDR + n) * 8 wraps for n near
     * 2^61, and the table may come from another process */
    if (ld(&t[H_MAGIC]) != KS_MAGIC || n == 0 || (n & (n - 1)) != 0 ||
        n > (uint64_t)b->len / 8 - KS_HDR) {
        PyErr_SetString(PyExc_ValueError, "buffer is not an initialised key set");
        return NULL;
    }
    *mask_out = n - 1;
    return t;
}

/* Slot index holding fp, or -1.  Bounded by nslots even if a racing rebuild scrambles it. */
static int64_t find(const uint64_t *slots, uint64_t mask, uint64_t fp) {
    uint64_t i = fp & mask;
    for (uint64_t k = 0; k <= mask; k++, i = (i + 1) & mask) {
        uint64_t s = ld(&slots[i]);
        if (s == fp) return (int64_t)i;
        if (s == KS_EMPTY) return -1;
    }
    return -1;
}

/* Insert without checks of load (the caller guarantees room).  1 if added, 0 if present. */
static int put(uint64_t *t, uint64_t mask, uint64_t fp) {
    uint64_t *slots = t + KS_HDR;
    uint64_t i = fp & mask;
    int64_t tomb = -1;
    for (uint64_t k = 0; k <= mask; k++, i = (i + 1) & mask) {
        uint64_t s = slots[i];
        if (s == fp) return 0;
        if (s == KS_TOMB && tomb < 0) tomb = (int64_t)i;
        if (s == KS_EMPTY) break;
    }
    if (tomb >= 0) {
        st(&slots[tomb], fp);
    } else {
        st(&slots[i], fp);
        st(&t[H_USED], t[H_USED] + 1);
    }
    st(&t[H_LIVE], t[H_LIVE] + 1);
    return 1;
}

static int key_bytes(PyObject *key, const char **p, Py_ssize_t *n) {
    if (!PyUnicode_Check(key)) { PyErr_SetString(PyExc_TypeError, "keys must be str"); return -1; }
    *p = PyUnicode_AsUTF8AndSize(key, n);
    return *p ? 0 : -1;
}

/* Count the leading fingerprints present, under the seqlock; -1 if the table cannot be
 * trusted now (invalid, or a rebuild kept moving slots). */
typedef int (*next_fp_fn)(void *ctx, Py_ssize_t i, uint64_t *fp);

static long long count_leading(const uint64_t *t, uint64_t mask, Py_ssize_t n, next_fp_fn next, void *ctx) {
    const uint64_t *slots = t + KS_HDR;
    for (int attempt = 0; attempt < KS_READ_TRIES; attempt++) {
        uint64_t s1 = __atomic_load_n(&t[H_SEQ], __ATOMIC_ACQUIRE);
        if (s1 & 1) continue;
        if (ld(&t[H_VALID]) != 1) return -1;
        Py_ssize_t hits = 0;
        for (; hits < n; hits++) {
            uint64_t fp;
            int r = next(ctx, hits, &fp);
            if (r < 0) return -2;
            if (find(slots, mask, fp) < 0) break;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (ld(&t[H_SEQ]) == s1) return hits;
    }
    return -1;
}

typedef struct { PyObject *seq; } keys_ctx;

static int next_key(void *vctx, Py_ssize_t i, uint64_t *fp) {
    keys_ctx *c = vctx;
    const char *p;
    Py_ssize_t n;
    if (key_bytes(PySequence_Fast_GET_ITEM(c->seq, i), &p, &n) < 0) return -1;
    *fp = fingerprint((const unsigned char *)p, (size_t)n);
    return 0;
}

typedef struct {
    PyObject *seq;
    char buf[KS_KEY_MAX];
    Py_ssize_t plen;
    const char *suffix;
    Py_ssize_t slen;
} ints_ctx;

static int next_int(void *vctx, Py_ssize_t i, uint64_t *fp) {
    static const char hex[] = "0123456789abcdef";
    ints_ctx *c = vctx;
    PyObject *item = PySequence_Fast_GET_ITEM(c->seq, i);
    if (!PyLong_CheckExact(item)) { PyErr_SetString(PyExc_TypeError, "hashes must be int"); return -1; }
    int overflow = 0;
    long long signed_v = PyLong_AsLongLongAndOverflow(item, &overflow);
    uint64_t v;
    if (overflow == 0) {
        if (signed_v < 0) { PyErr_SetString(PyExc_OverflowError, "negative hash"); return -1; }
        v = (uint64_t)signed_v;
    } else {
        if (overflow < 0) { PyErr_SetString(PyExc_OverflowError, "negative hash"); return -1; }
        v = PyLong_AsUnsignedLongLong(item);  /* raises OverflowError past 64 bits */
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    char digits[16];
    int nd = 0;
    do { digits[15 - nd++] = hex[v & 15]; v >>= 4; } while (v);
    char *w = c->buf + c->plen;
    memcpy(w, digits + 16 - nd, (size_t)nd);
    memcpy(w + nd, c->suffix, (size_t)c->slen);
    *fp = fingerprint((const unsigned char *)c->buf, (size_t)(c->plen + nd + c->slen));
    return 0;
}

static PyObject *count_result(long long r) {
    if (r == -2) return NULL;  /* a Python error is set */
    return PyLong_FromLongLong(r);
}

/* What count_keys and count_ints share: map the table, walk the sequence, count.  `seq`
 * points into `ctx` (where the next_fp function finds the items). */
static PyObject *count_with(PyObject *table, PyObject *items, const char *what, PyObject **seq,
                            next_fp_fn next, void *ctx) {
    if (!(*seq = PySequence_Fast(items, what))) return NULL;
    PyObject *res = NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(table, &b, PyBUF_SIMPLE) == 0) {
        uint64_t mask;
        const uint64_t *t = table_of(&b, &mask);
        if (t) res = count_result(count_leading(t, mask, PySequence_Fast_GET_SIZE(*seq), next, ctx));
        PyBuffer_Release(&b);
    }
    Py_CLEAR(*seq);
    return res;
}

/* count_keys(table, keys) -> leading keys present, or -1 (ask the daemon). */
static PyObject *py_count_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "count_keys(table, keys)"); return NULL; }
    keys_ctx c;
    return count_with(args[0], args[1], "keys must be a sequence", &c.seq, next_key, &c);
}

/* count_ints(table, prefix, hashes, suffix) -> leading keys prefix + "%x" % h + suffix
 * present, or -1 (ask the daemon); OverflowError for a negative or wider-than-64-bit hash. */
static PyObject *py_count_ints(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyBytes_Check(args[1]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "count_ints(table, prefix: bytes, hashes, suffix: bytes)");
        return NULL;
    }
    ints_ctx c;
    c.plen = PyBytes_GET_SIZE(args[1]);
    c.slen = PyBytes_GET_SIZE(args[3]);
    if (c.plen + c.slen + 16 > KS_KEY_MAX) { PyErr_SetString(PyExc_ValueError, "key prefix and suffix too long"); return NULL; }
    c.suffix = PyBytes_AS_STRING(args[3]);
    memcpy(c.buf, PyBytes_AS_STRING(args[1]), (size_t)c.plen);
    return count_with(args[0], args[2], "hashes must be a sequence", &c.seq, next_int, &c);
}

/* init(table) -> nslots: an empty, valid table filling the writable buffer, which must be
 * zero (a fresh memfd is): the slots are not written, so a large sparse table stays sparse. */
static PyObject *py_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "init(table)"); return NULL; }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t room = b.len >= (Py_ssize_t)(KS_HDR * 8) ? (uint64_t)b.len / 8 - KS_HDR : 0, n = 1;
    while (n * 2 <= room) n *= 2;
    if (room < 2) { PyBuffer_Release(&b); PyErr_SetString(PyExc_ValueError, "key set buffer too small"); return NULL; }
    uint64_t *t = b.buf;
    memset(t, 0, KS_HDR * 8);
    t[H_NSLOTS] = n;
    t[H_VALID] = 1;
    __atomic_store_n(&t[H_MAGIC], KS_MAGIC, __ATOMIC_RELEASE);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(n);
}

/* Writer side: one key's fingerprint applied to the writable table. */
typedef long (*key_op)(uint64_t *t, uint64_t mask, uint64_t fp);

static long op_add(uint64_t *t, uint64_t mask, uint64_t fp) {
    if (find(t + KS_HDR, mask, fp) >= 0) return 0;
    if (t[H_USED] + 1 > (mask + 1) / 4 * 3) return -1;
    return put(t, mask, fp);
}

static long op_discard(uint64_t *t, uint64_t mask, uint64_t fp) {
    int64_t i = find(t + KS_HDR, mask, fp);
    if (i < 0) return 0;
    st(&t[KS_HDR + i], KS_TOMB);
    st(&t[H_LIVE], t[H_LIVE] - 1);
    return 1;
}

static PyObject *with_key(PyObject *const *args, Py_ssize_t nargs, const char *usage, key_op op) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, usage); return NULL; }
    const char *p;
    Py_ssize_t n;
    if (key_bytes(args[1], &p, &n) < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t mask;
    uint64_t *t = table_of(&b, &mask);
    long r = t ? op(t, mask, fingerprint((const unsigned char *)p, (size_t)n)) : 0;
    PyBuffer_Release(&b);
    return t ? PyLong_FromLong(r) : NULL;
}

/* add(table, key) -> 1 added, 0 already there, -1 no room (rebuild first). */
static PyObject *py_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return with_key(args, nargs, "add(table, key)", op_add);
}

/* discard(table, key) -> 1 removed, 0 was absent. */
static PyObject *py_discard(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return with_key(args, nargs, "discard(table, key)", op_discard);
}

/* rebuild(table, keys) -> live count: the table holds exactly ``keys`` (no tombstones),
 * rewritten inside an odd seq.  If they exceed 3/4 of the slots the table is left
 * invalid (readers ask the daemon) and the count is still returned. */
static PyObject *py_rebuild(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "rebuild(table, keys)"); return NULL; }
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t nkeys = PySequence_Fast_GET_SIZE(seq);
    uint64_t *fps = PyMem_Malloc((size_t)(nkeys ? nkeys : 1) * 8);
    if (!fps) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        const char *p;
        Py_ssize_t n;
        if (key_bytes(PySequence_Fast_GET_ITEM(seq, i), &p, &n) < 0) { PyMem_Free(fps); Py_DECREF(seq); return NULL; }
        fps[i] = fingerprint((const unsigned char *)p, (size_t)n);
    }
    Py_DECREF(seq);
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) { PyMem_Free(fps); return NULL; }
    uint64_t mask;
    uint64_t *t = table_of(&b, &mask);
    if (!t) { PyMem_Free(fps); PyBuffer_Release(&b); return NULL; }
    uint64_t seq0 = t[H_SEQ];
    __atomic_store_n(&t[H_SEQ], seq0 + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    int fits = (uint64_t)nkeys <= (mask + 1) / 4 * 3;
    memset(t + KS_HDR, 0, (mask + 1) * 8);
    t[H_LIVE] = t[H_USED] = 0;
    if (fits)
        for (Py_ssize_t i = 0; i < nkeys; i++) put(t, mask, fps[i]);
    t[H_VALID] = (uint64_t)fits;
    __atomic_store_n(&t[H_SEQ], seq0 + 2, __ATOMIC_RELEASE);
    PyMem_Free(fps);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(nkeys);
}

/* invalidate(table): readers stop trusting it (the daemon is closing the space). */
static PyObject *py_invalidate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "invalidate(table)"); return NULL; }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t mask;
    uint64_t *t = table_of(&b, &mask);
    if (t) __atomic_store_n(&t[H_VALID], 0, __ATOMIC_RELEASE);
    PyBuffer_Release(&b);
    if (!t) return NULL;
    Py_RETURN_NONE;
}

/* stats(table) -> (nslots, live, used, valid) */
static PyObject *py_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "stats(table)"); return NULL; }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t mask;
    const uint64_t *t = table_of(&b, &mask);
    PyObject *res = t ? Py_BuildValue("(KKKK)", (unsigned long long)(mask + 1), (unsigned long long)ld(&t[H_LIVE]),
                                      (unsigned long long)ld(&t[H_USED]), (unsigned long long)ld(&t[H_VALID]))
                      : NULL;
    PyBuffer_Release(&b);
    return res;
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    FAST("count_keys", py_count_keys, "count_keys(table, keys) -> leading keys present, or -1 (table not usable now)"),
    FAST("count_ints", py_count_ints, "count_ints(table, prefix, hashes, suffix) -> leading keys prefix+hex(h)+suffix present, or -1"),
    FAST("init", py_init, "init(table) -> nslots; an empty valid table over the writable buffer"),
    FAST("add", py_add, "add(table, key) -> 1 added, 0 present, -1 no room"),
    FAST("discard", py_discard, "discard(table, key) -> 1 removed, 0 absent"),
    FAST("rebuild", py_rebuild, "rebuild(table, keys) -> live; the table holds exactly keys (invalid if they do not fit)"),
    FAST("invalidate", py_invalidate, "invalidate(table): readers stop trusting it"),
    FAST("stats", py_stats, "stats(table) -> (nslots, live, used, valid)"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyset",
                                    "A key set in shared memory: one writer, lock-free readers.", -1, methods};

PyMODINIT_FUNC PyInit__keyset(void) { return PyModule_Create(&module); }
