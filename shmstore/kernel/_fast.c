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

static Py_ssize_t ENTRY_SIZE, HASH_OFF, NEXT_OFF, KEYLEN_OFF, SESSION_OFF, STATE_OFF, KEY_OFF;
static long SEALED;
static int configured;

static PyObject *configure(PyObject *self, PyObject *args) {
    if (!PyArg_ParseTuple(args, "nnnnnnnl", &ENTRY_SIZE, &HASH_OFF, &NEXT_OFF, &KEYLEN_OFF, &SESSION_OFF,
                          &STATE_OFF, &KEY_OFF, &SEALED))
        return NULL;
    configured = 1;
    Py_RETURN_NONE;
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
    int rc = pthread_mutex_trylock(m);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return PyLong_FromLong(-3);
    }
    if (rc != 0)
        return PyLong_FromLong(-2);
    char *base = (char *)(uintptr_t)meta;
    int32_t rec;
    memcpy(&rec, base + buckets + 4 * b, 4);
    Py_ssize_t idx = -1, eoff = 0;
    while (rec) {
        eoff = entries + (Py_ssize_t)(rec - 1) * ENTRY_SIZE;
        char *e = base + eoff;
        uint32_t eh;
        uint16_t el, es;
        memcpy(&eh, e + HASH_OFF, 4);
        memcpy(&el, e + KEYLEN_OFF, 2);
        memcpy(&es, e + SESSION_OFF, 2);
        if (eh == h && el == klen && es == sid && memcmp(e + KEY_OFF, key, (size_t)klen) == 0) {
            idx = rec - 1;
            break;
        }
        memcpy(&rec, e + NEXT_OFF, 4);
    }
    if (idx < 0 || (unsigned char)base[eoff + STATE_OFF] != SEALED) {
        pthread_mutex_unlock(m);
        return PyLong_FromLong(-1);
    }
    if (pin) {
        PyObject *k = PyLong_FromSsize_t(idx);
        if (k == NULL) {
            pthread_mutex_unlock(m);
            return NULL;
        }
        PyObject *n = PyDict_GetItemWithError(pins, k);
        long count = n ? PyLong_AsLong(n) : 0;
        PyObject *v = PyLong_FromLong(count + 1);
        if (v == NULL || PyDict_SetItem(pins, k, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(k);
            pthread_mutex_unlock(m);
            return NULL;
        }
        Py_DECREF(v);
        Py_DECREF(k);
        if (count == 0)
            ((volatile char *)(uintptr_t)pins_addr)[idx] = 1;
    }
    pthread_mutex_unlock(m);
    return Py_BuildValue("(nn)", idx, eoff);
}

/* pin(pins, idx, pins_addr): one more local pin (the stripe lock of idx is held). */
static PyObject *pin(PyObject *self, PyObject *args) {
    PyObject *pins;
    Py_ssize_t idx;
    unsigned long long pins_addr;
    if (!PyArg_ParseTuple(args, "O!nK", &PyDict_Type, &pins, &idx, &pins_addr))
        return NULL;
    PyObject *k = PyLong_FromSsize_t(idx);
    if (k == NULL)
        return NULL;
    PyObject *n = PyDict_GetItemWithError(pins, k);
    long count = n ? PyLong_AsLong(n) : 0;
    PyObject *v = PyLong_FromLong(count + 1);
    int rc = v ? PyDict_SetItem(pins, k, v) : -1;
    Py_XDECREF(v);
    Py_DECREF(k);
    if (rc < 0)
        return NULL;
    if (count == 0)
        ((volatile char *)(uintptr_t)pins_addr)[idx] = 1;
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
    {"pin", pin, METH_VARARGS, "One more local pin (stripe lock held)."},
    {"unpin", unpin, METH_VARARGS, "Drop one local pin; True when it was the last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }
