/* Optional C fast path of the kernel's lookup-and-pin and unpin.
 *
 * The pure-Python kernel does the same thing; this module only saves the
 * interpreter's overhead on the hottest path (a get of a small object). It
 * knows no binary layout of its own: layout.py hands it every offset through
 * configure(), and the kernel passes the store's section offsets on each call.
 *
 * Both functions run with the GIL held from start to end, so their updates of
 * the process-local pin counts are atomic with respect to other threads of
 * the process; the kernel uses them for both pinning and unpinning, or for
 * neither.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static Py_ssize_t ENTRY_SIZE, HASH_OFF, NEXT_OFF, KEYLEN_OFF, SESSION_OFF, STATE_OFF, KEY_OFF, ARRAY_OFF;
static Py_ssize_t STATS_OBJECTS_OFF;
static long SEALED, WRITING;
static int configured;

static PyObject *configure(PyObject *self, PyObject *args) {
    if (!PyArg_ParseTuple(args, "nnnnnnnllnn", &ENTRY_SIZE, &HASH_OFF, &NEXT_OFF, &KEYLEN_OFF, &SESSION_OFF,
                          &STATE_OFF, &KEY_OFF, &SEALED, &WRITING, &ARRAY_OFF, &STATS_OBJECTS_OFF))
        return NULL;
    configured = 1;
    Py_RETURN_NONE;
}

/* Walk bucket b's chain for key: the 0-based entry index, or -1. */
static Py_ssize_t find(char *base, Py_ssize_t buckets, Py_ssize_t entries, Py_ssize_t b, unsigned long h,
                       unsigned long sid, const char *key, Py_ssize_t klen, Py_ssize_t *eoff_out) {
    int32_t rec;
    memcpy(&rec, base + buckets + 4 * b, 4);
    while (rec) {
        Py_ssize_t eoff = entries + (Py_ssize_t)(rec - 1) * ENTRY_SIZE;
        char *e = base + eoff;
        uint32_t eh;
        uint16_t el, es;
        memcpy(&eh, e + HASH_OFF, 4);
        memcpy(&el, e + KEYLEN_OFF, 2);
        memcpy(&es, e + SESSION_OFF, 2);
        if (eh == h && el == klen && es == sid && memcmp(e + KEY_OFF, key, (size_t)klen) == 0) {
            *eoff_out = eoff;
            return rec - 1;
        }
        memcpy(&rec, e + NEXT_OFF, 4);
    }
    return -1;
}

/* Take a robust mutex without waiting: 0 taken, -2 busy, -3 taken from a dead holder
 * (made consistent: the caller repairs and releases). */
static int try_take(pthread_mutex_t *m) {
    int rc = pthread_mutex_trylock(m);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return -3;
    }
    return rc ? -2 : 0;
}

/* One more local pin on idx in ``pins``; the first sets this client's pin byte.
 * 0, or -1 with an exception set. Allocates no GC-tracked object, so no
 * finalizer can run inside (the caller may hold a store lock). */
static int count_pin(PyObject *pins, Py_ssize_t idx, unsigned long long pins_addr) {
    PyObject *k = PyLong_FromSsize_t(idx);
    if (k == NULL)
        return -1;
    PyObject *n = PyDict_GetItemWithError(pins, k);
    long count = n ? PyLong_AsLong(n) : 0;
    PyObject *v = PyLong_FromLong(count + 1);
    int rc = v ? PyDict_SetItem(pins, k, v) : -1;
    Py_XDECREF(v);
    Py_DECREF(k);
    if (rc == 0 && count == 0)
        ((volatile char *)(uintptr_t)pins_addr)[idx] = 1;
    return rc;
}

/* lookup_pin(meta, buckets, entries, b, h, sid, key, lock, pins_addr, pins, pin) ->
 *   (idx, eoff) when found sealed (pinned if ``pin``), -1 when not, -2 when the
 *   lock is busy, -3 when its previous holder died: the caller then holds it,
 *   made consistent, and must repair and release it. */
static PyObject *lookup_pin(PyObject *self, PyObject *args) {
    unsigned long long meta, lock, pins_addr;
    Py_ssize_t buckets, entries, b, klen;
    unsigned long h, sid;
    const char *key;
    PyObject *pins;
    int pin;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_fast.configure() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Knnnkky#KKO!p", &meta, &buckets, &entries, &b, &h, &sid, &key, &klen, &lock,
                          &pins_addr, &PyDict_Type, &pins, &pin))
        return NULL;
    pthread_mutex_t *m = (pthread_mutex_t *)(uintptr_t)lock;
    int rc = try_take(m);
    if (rc)
        return PyLong_FromLong(rc);
    char *base = (char *)(uintptr_t)meta;
    Py_ssize_t eoff = 0;
    Py_ssize_t idx = find(base, buckets, entries, b, h, sid, key, klen, &eoff);
    if (idx < 0 || (unsigned char)base[eoff + STATE_OFF] != SEALED) {
        pthread_mutex_unlock(m);
        return PyLong_FromLong(-1);
    }
    if (pin && count_pin(pins, idx, pins_addr) < 0) {
        pthread_mutex_unlock(m);
        return NULL;
    }
    pthread_mutex_unlock(m);
    return Py_BuildValue("(nn)", idx, eoff);
}

/* insert(meta, buckets, entries, b, h, sid, key, lock, idx, head, array, stats, level, nbytes) ->
 *   0 when entry idx (head: its packed ENTRY_HEAD, array: its ENTRY_ARRAY bytes or
 *   None) is written, keyed, counted in its stripe (stats: that stripe's record;
 *   nbytes on ``level``) and linked at the head of bucket b; -2/-3 as try_take;
 *   -4 when the key is being written, -5 when it exists. */
static PyObject *insert(PyObject *self, PyObject *args) {
    unsigned long long meta, lock, stats;
    Py_ssize_t buckets, entries, b, klen, idx, level, hlen, nbytes;
    unsigned long h, sid;
    const char *key, *head;
    PyObject *array;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_fast.configure() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Knnnkky#Kny#OKnn", &meta, &buckets, &entries, &b, &h, &sid, &key, &klen, &lock,
                          &idx, &head, &hlen, &array, &stats, &level, &nbytes))
        return NULL;
    Py_buffer ab = {0};
    if (array != Py_None && PyObject_GetBuffer(array, &ab, PyBUF_SIMPLE) < 0)
        return NULL;
    pthread_mutex_t *m = (pthread_mutex_t *)(uintptr_t)lock;
    int rc = try_take(m);
    if (rc == 0) {
        char *base = (char *)(uintptr_t)meta;
        Py_ssize_t found_off = 0;
        if (find(base, buckets, entries, b, h, sid, key, klen, &found_off) >= 0) {
            rc = (unsigned char)base[found_off + STATE_OFF] == WRITING ? -4 : -5;
        } else {
            char *e = base + entries + idx * ENTRY_SIZE;
            memcpy(e, head, (size_t)hlen);
            if (ab.buf)
                memcpy(e + ARRAY_OFF, ab.buf, (size_t)ab.len);
            memcpy(e + KEY_OFF, key, (size_t)klen);
            char *st = (char *)(uintptr_t)stats;
            int64_t used, objects;
            memcpy(&used, st + 8 * level, 8);
            memcpy(&objects, st + STATS_OBJECTS_OFF, 8);
            used += nbytes;
            objects += 1;
            memcpy(st + 8 * level, &used, 8);
            memcpy(st + STATS_OBJECTS_OFF, &objects, 8);
            int32_t first, rec = (int32_t)(idx + 1);
            memcpy(&first, base + buckets + 4 * b, 4);
            memcpy(e + NEXT_OFF, &first, 4);
            memcpy(base + buckets + 4 * b, &rec, 4); /* the publishing store, after the entry is whole */
        }
        pthread_mutex_unlock(m);
    }
    if (ab.buf)
        PyBuffer_Release(&ab);
    return PyLong_FromLong(rc);
}

/* set_byte(lock, addr, value) -> 0 once *addr = value under the lock, else -2/-3 as try_take. */
static PyObject *set_byte(PyObject *self, PyObject *args) {
    unsigned long long lock, addr;
    int value;
    if (!PyArg_ParseTuple(args, "KKi", &lock, &addr, &value))
        return NULL;
    pthread_mutex_t *m = (pthread_mutex_t *)(uintptr_t)lock;
    int rc = try_take(m);
    if (rc == 0) {
        ((volatile unsigned char *)(uintptr_t)addr)[0] = (unsigned char)value;
        pthread_mutex_unlock(m);
    }
    return PyLong_FromLong(rc);
}

/* pin(pins, idx, pins_addr): one more local pin (the stripe lock of idx is held). */
static PyObject *pin(PyObject *self, PyObject *args) {
    PyObject *pins;
    Py_ssize_t idx;
    unsigned long long pins_addr;
    if (!PyArg_ParseTuple(args, "O!nK", &PyDict_Type, &pins, &idx, &pins_addr))
        return NULL;
    if (count_pin(pins, idx, pins_addr) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* unpin(pins, idx, pins_addr) -> True when that was this process's last pin on idx. */
static PyObject *unpin(PyObject *self, PyObject *args) {
    PyObject *pins;
    Py_ssize_t idx;
    unsigned long long pins_addr;
    if (!PyArg_ParseTuple(args, "O!nK", &PyDict_Type, &pins, &idx, &pins_addr))
        return NULL;
    PyObject *k = PyLong_FromSsize_t(idx);
    if (k == NULL)
        return NULL;
    PyObject *n = PyDict_GetItemWithError(pins, k);
    if (n == NULL) {
        Py_DECREF(k);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    long count = PyLong_AsLong(n) - 1;
    int rc;
    if (count > 0) {
        PyObject *v = PyLong_FromLong(count);
        rc = v ? PyDict_SetItem(pins, k, v) : -1;
        Py_XDECREF(v);
    } else {
        rc = PyDict_DelItem(pins, k);
        ((volatile char *)(uintptr_t)pins_addr)[idx] = 0;
    }
    Py_DECREF(k);
    if (rc < 0)
        return NULL;
    if (count > 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the entry layout (from layout.py)."},
    {"lookup_pin", lookup_pin, METH_VARARGS, "Find a sealed entry under its stripe lock and pin it."},
    {"insert", insert, METH_VARARGS, "Write, count and link a reserved entry under its stripe lock."},
    {"set_byte", set_byte, METH_VARARGS, "Store one byte under a lock (sealing an entry)."},
    {"pin", pin, METH_VARARGS, "One more local pin (stripe lock held)."},
    {"unpin", unpin, METH_VARARGS, "Drop one local pin; True when it was the last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }
