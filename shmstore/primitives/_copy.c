/* Optional C helper for bulk copies into the shared-memory arena.
 *
 * copy_blobs(dst, items) copies each (offset, buffer) of items into the
 * writable buffer dst at offset, with the GIL released for the copies, so several Python
 * threads can copy at once. Pieces of NT_MIN bytes or more are written with
 * non-temporal (streaming) stores on x86-64: the destination is shared
 * memory that this process rarely reads back at once, and streaming stores
 * skip reading each destination line into the cache first. glibc's memcpy
 * switches to them only for copies larger than a good part of the cache,
 * which a state dict's arrays of a few hundred KiB are not. Smaller pieces
 * and other CPUs use memcpy.
 *
 * Every item is checked against dst's length before anything is copied; a bad
 * item raises ValueError and copies nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_NT 1
#else
#define HAVE_NT 0
#endif

#define NT_MIN (64 * 1024)

#if HAVE_NT
static int have_avx2;

__attribute__((target("avx2"))) static void nt_copy_avx2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
}

static void nt_copy_sse2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

static void copy_piece(char *dst, const char *src, size_t n) {
#if HAVE_NT
    if (n >= NT_MIN) {
        size_t head = (size_t)((32 - ((uintptr_t)dst & 31)) & 31);
        memcpy(dst, src, head);
        if (have_avx2)
            nt_copy_avx2(dst + head, src + head, n - head);
        else
            nt_copy_sse2(dst + head, src + head, n - head);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static PyObject *copy_blobs(PyObject *self, PyObject *args) {
    Py_buffer dst;
    Py_ssize_t dst_len, n, i, got = 0;
    PyObject *items, *seq;
    if (!PyArg_ParseTuple(args, "w*O", &dst, &items))
        return NULL;
    dst_len = dst.len;
    seq = PySequence_Fast(items, "items must be a sequence of (offset, buffer)");
    if (seq == NULL) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Py_ssize_t *offs = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (views == NULL || offs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *buf;
        if (!PyArg_ParseTuple(item, "nO", &offs[i], &buf))
            goto done;
        if (PyObject_GetBuffer(buf, &views[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        got++;
        if (offs[i] < 0 || views[i].len > dst_len || offs[i] > dst_len - views[i].len) {
            PyErr_Format(PyExc_ValueError, "piece %zd (offset %zd, %zd bytes) does not fit in %zd bytes", i,
                         offs[i], views[i].len, dst_len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++)
        copy_piece((char *)dst.buf + offs[i], views[i].buf, (size_t)views[i].len);
#if HAVE_NT
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
done:
    for (i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(offs);
    Py_DECREF(seq);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_blobs", copy_blobs, METH_VARARGS,
     "copy_blobs(dst, [(offset, buffer), ...]): copy each buffer into the writable buffer dst at offset, "
     "GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
#if HAVE_NT
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
