/*
 * Block lists as dict keys (IntKey by value, RefKey by the identity of the entries): a
 * call that repeats a call shape finds its plan by them in a fraction of a tuple's cost.
 */
#include "native.h"

/* Block lists as dict keys.  A plain call that repeats a call shape finds its plan by its
 * block lists, which may hold thousands of entries: a tuple of them costs a conversion, a
 * hash that visits every int object and an element-wise compare, tens of microseconds at
 * 4096 entries.  An IntKey is the values themselves as int64 with a hash computed in the
 * same single pass; equal keys compare with one memcmp. */
typedef struct {
    PyObject_VAR_HEAD
    Py_hash_t hash;
    int64_t v[1];
} IntKey;

static Py_hash_t intkey_hash(PyObject *self) { return ((IntKey *)self)->hash; }

static PyObject *intkey_richcompare(PyObject *a, PyObject *b, int op);

static PyObject *intkey_repr(PyObject *self) {
    return PyUnicode_FromFormat("IntKey(%zd ints)", Py_SIZE(self));
}

static PyTypeObject IntKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "datadist.engine._native.IntKey",
    .tp_basicsize = offsetof(IntKey, v),
    .tp_itemsize = sizeof(int64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A list of exact ints as a hashable key (made by int_key).",
    .tp_hash = intkey_hash,
    .tp_richcompare = intkey_richcompare,
    .tp_repr = intkey_repr,
};

static PyObject *intkey_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != &IntKeyType || Py_TYPE(b) != &IntKeyType)
        Py_RETURN_NOTIMPLEMENTED;
    IntKey *x = (IntKey *)a, *y = (IntKey *)b;
    int eq = Py_SIZE(x) == Py_SIZE(y) && x->hash == y->hash &&
             memcmp(x->v, y->v, (size_t)Py_SIZE(x) * sizeof(int64_t)) == 0;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

/* RefKey: two block lists as a dict key by the identity of their entries.  Reading a
 * Python int costs a visit to its object (about 1.6 ns each on a virtual machine: 13 us
 * for two lists of 4096), while the lists' arrays of entry pointers are contiguous, so a
 * key over the pointers costs a fraction of that.  A probe (ref_key) holds the two lists
 * and hashes their entry pointers; a pinned key (RefKey.pinned(), what a memory keeps)
 * holds a reference to every entry, so no other object can take an entry's address while
 * it is kept: a probe equal to a pinned key holds the very same int objects, hence the same
 * values.  Only keys whose entries are all exact ints are pinned. */
typedef struct {
    PyObject_HEAD
    Py_hash_t hash;
    Py_ssize_t n[2];
    PyObject *seq[2];   /* a probe's two lists or tuples (entries read live); NULL when pinned */
    PyObject **items;   /* a pinned key's n[0] + n[1] entries (owned); NULL for a probe */
} RefKey;

static PyTypeObject RefKeyType;

static PyObject **refkey_items(RefKey *k, int i) {
    if (k->items != NULL) return k->items + (i ? k->n[0] : 0);
    return PySequence_Fast_ITEMS(k->seq[i]);
}

static int refkey_sizes_hold(RefKey *k) {
    return k->items != NULL ||
           (PySequence_Fast_GET_SIZE(k->seq[0]) == k->n[0] && PySequence_Fast_GET_SIZE(k->seq[1]) == k->n[1]);
}

static void refkey_dealloc(PyObject *self) {
    RefKey *k = (RefKey *)self;
    Py_XDECREF(k->seq[0]);
    Py_XDECREF(k->seq[1]);
    if (k->items != NULL) {
        for (Py_ssize_t i = 0; i < k->n[0] + k->n[1]; i++) Py_DECREF(k->items[i]);
        PyMem_Free(k->items);
    }
    Py_TYPE(self)->tp_free(self);
}

static Py_hash_t refkey_hash(PyObject *self) { return ((RefKey *)self)->hash; }

static PyObject *refkey_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != &RefKeyType || Py_TYPE(b) != &RefKeyType)
        Py_RETURN_NOTIMPLEMENTED;
    RefKey *x = (RefKey *)a, *y = (RefKey *)b;
    int eq = x->hash == y->hash && x->n[0] == y->n[0] && x->n[1] == y->n[1] && refkey_sizes_hold(x) &&
             refkey_sizes_hold(y);
    for (int i = 0; eq && i < 2; i++)
        eq = memcmp(refkey_items(x, i), refkey_items(y, i), (size_t)x->n[i] * sizeof(PyObject *)) == 0;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

/* pinned(): this key holding a reference to every entry (None if one is not an exact int). */
static PyObject *refkey_pinned(PyObject *self, PyObject *unused) {
    (void)unused;
    RefKey *k = (RefKey *)self;
    if (k->items != NULL) { Py_INCREF(self); return self; }
    if (!refkey_sizes_hold(k)) Py_RETURN_NONE;
    Py_ssize_t total = k->n[0] + k->n[1];
    for (int i = 0; i < 2; i++) {
        PyObject **it = refkey_items(k, i);
        for (Py_ssize_t j = 0; j < k->n[i]; j++)
            if (Py_TYPE(it[j]) != &PyLong_Type) Py_RETURN_NONE;
    }
    PyObject **items = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(PyObject *));
    if (items == NULL) return PyErr_NoMemory();
    memcpy(items, refkey_items(k, 0), (size_t)k->n[0] * sizeof(PyObject *));
    memcpy(items + k->n[0], refkey_items(k, 1), (size_t)k->n[1] * sizeof(PyObject *));
    for (Py_ssize_t i = 0; i < total; i++) Py_INCREF(items[i]);
    RefKey *p = PyObject_New(RefKey, &RefKeyType);
    if (p == NULL) {
        for (Py_ssize_t i = 0; i < total; i++) Py_DECREF(items[i]);
        PyMem_Free(items);
        return NULL;
    }
    p->hash = k->hash;
    p->n[0] = k->n[0];
    p->n[1] = k->n[1];
    p->seq[0] = p->seq[1] = NULL;
    p->items = items;
    return (PyObject *)p;
}

static PyMethodDef refkey_methods[] = {
    {"pinned", refkey_pinned, METH_NOARGS, "pinned() -> this key holding its entries, or None"},
    {NULL, NULL, 0, NULL},
};

static PyObject *refkey_repr(PyObject *self) {
    RefKey *k = (RefKey *)self;
    return PyUnicode_FromFormat("RefKey(%zd + %zd entries%s)", k->n[0], k->n[1], k->items ? ", pinned" : "");
}

static PyTypeObject RefKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "datadist.engine._native.RefKey",
    .tp_basicsize = sizeof(RefKey),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Two block lists as a hashable key by the identity of their entries (made by ref_key).",
    .tp_dealloc = refkey_dealloc,
    .tp_hash = refkey_hash,
    .tp_richcompare = refkey_richcompare,
    .tp_repr = refkey_repr,
    .tp_methods = refkey_methods,
};

/* One entry's share of a RefKey's hash: mixed on its own with its position, then added
 * (independent mixes: see int_key). */
static inline uint64_t refkey_mix(PyObject *entry, Py_ssize_t j, uint64_t salt) {
    uint64_t z = ((uint64_t)(uintptr_t)entry ^ ((uint64_t)j * 0x9E3779B97F4A7C15ull + salt)) * 0xBF58476D1CE4E5B9ull;
    return z ^ (z >> 29);
}

/* ref_key(a, b, limit): a probe RefKey of two lists or tuples of together at most limit
 * entries; None for anything else.  Hashes the entry pointers, never visits an entry. */
static PyObject *py_ref_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "ref_key(a, b, limit)"); return NULL; }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    for (int i = 0; i < 2; i++)
        if (!PyList_CheckExact(args[i]) && !PyTuple_CheckExact(args[i])) Py_RETURN_NONE;
    Py_ssize_t n0 = PySequence_Fast_GET_SIZE(args[0]), n1 = PySequence_Fast_GET_SIZE(args[1]);
    if (n0 + n1 > limit) Py_RETURN_NONE;
    RefKey *k = PyObject_New(RefKey, &RefKeyType);
    if (k == NULL) return NULL;
    k->n[0] = n0;
    k->n[1] = n1;
    k->items = NULL;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n0 ^ ((uint64_t)n1 << 32);
    for (int i = 0; i < 2; i++) {
        Py_INCREF(args[i]);
        k->seq[i] = args[i];
        PyObject **it = PySequence_Fast_ITEMS(args[i]);
        uint64_t salt = i ? 0xD6E8FEB86659FD93ull : 0;
        /* About 128 entries of each list are hashed (all of a short one, and the last):
         * equality compares every pointer anyway, so a key that shares the sampled ones
         * costs a memcmp that stops at the first difference, never a wrong match. */
        Py_ssize_t n = k->n[i], step = n > 128 ? n / 128 : 1;
        for (Py_ssize_t j = 0; j < n; j += step) h += refkey_mix(it[j], j, salt);
        if (n && (n - 1) % step) h += refkey_mix(it[n - 1], n - 1, salt);  /* the last, if skipped */
    }
    h = (h ^ (h >> 32)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    Py_hash_t hash = (Py_hash_t)h;
    k->hash = hash == -1 ? -2 : hash;
    return (PyObject *)k;
}

/* int_key(seq, limit): a list or tuple of at most limit exact ints as an IntKey; None for
 * any other type, for any entry that is not exactly an int (1.0 and True compare equal to
 * 1 but are not block indices), for one outside int64 and for more than limit entries. */
static PyObject *py_int_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "int_key(seq, limit)"); return NULL; }
    PyObject *seq = args[0];
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > limit) Py_RETURN_NONE;
    IntKey *key = PyObject_NewVar(IntKey, &IntKeyType, n);
    if (key == NULL) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* Each value is mixed with its position on its own and the mixes are added: no chain
     * of multiplies from one entry to the next, so the loop runs at the speed of the loads. */
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        if (dd_exact_int(items[i], &v) < 0) { Py_DECREF(key); Py_RETURN_NONE; }
        key->v[i] = v;
        uint64_t z = ((uint64_t)v ^ ((uint64_t)i * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
        h += z ^ (z >> 29);
    }
    h = (h ^ (h >> 32)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    Py_hash_t hash = (Py_hash_t)h;
    key->hash = hash == -1 ? -2 : hash;  /* -1 means "error" to a tp_hash */
    return (PyObject *)key;
}

PyMethodDef dd_key_methods[] = {
    {"ref_key", (PyCFunction)(void (*)(void))py_ref_key, METH_FASTCALL,
     "ref_key(a, b, limit) -> a RefKey of two lists or tuples by the identity of their entries; None otherwise"},
    {"int_key", (PyCFunction)(void (*)(void))py_int_key, METH_FASTCALL,
     "int_key(seq, limit) -> a list or tuple of exact ints as a hashable IntKey; None otherwise or if longer than limit"},
    {NULL, NULL, 0, NULL},
};

/* Add the key types to module m: 0, or -1 with an exception set. */
int dd_add_key_types(PyObject *m) {
    PyTypeObject *types[] = {&IntKeyType, &RefKeyType};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyModule_AddType(m, types[i]) < 0) return -1; /* readies the type, and adds a reference */
    return 0;
}
