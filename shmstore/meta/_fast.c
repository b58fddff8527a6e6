/* Optional C fast path of the kernel: lookup-and-pin, unpin, insert and seal.
 *
 * The pure-Python kernel does the same things; this module only saves the
 * interpreter's overhead on the hottest paths (a put or get of a small
 * object). It knows no binary layout of its own: the layout package hands it every
 * offset and width through configure(), and the kernel passes the store's addresses,
 * once in a context capsule (get_entry, release) or on each call.
 *
 * Every function runs with the GIL held from start to end, so their updates
 * of the process-local pin counts are atomic with respect to other threads of
 * the process; the kernel uses them for both pinning and unpinning, or for
 * neither.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static Py_ssize_t ENTRY_SIZE, HASH_OFF, NEXT_OFF, KEYLEN_OFF, SESSION_OFF, STATE_OFF, KEY_OFF, ARRAY_OFF;
static Py_ssize_t STATS_OBJECTS_OFF, OFFSET_OFF, NBYTES_OFF, ATIME_OFF, GEN_OFF, KIND_OFF, LEVEL_OFF, MAX_KEY;
static Py_ssize_t WRITER_OFF, SIZE_OFF, CTIME_OFF, EXTENT_OFF, NBLOBS_OFF, FLAGS_OFF, ARRAY_SIZE;
static Py_ssize_t BUCKET_WIDTH, STATS_USED_OFF, STATS_USED_WIDTH, STATS_OBJECTS_WIDTH, STRIPE_SHIFT;
static long SEALED, WRITING, DELETED, RESERVED;

/* The width this file reads and writes each field with (the C type of its PUT/memcpy): configure() refuses
 * a layout that declares another, which would otherwise be written wrongly with no error. */
static const struct { const char *name; Py_ssize_t width; } WIDTHS[] = {
    {"offset_width", sizeof(uint64_t)}, {"size_width", sizeof(uint64_t)}, {"nbytes_width", sizeof(uint64_t)},
    {"atime_width", sizeof(double)}, {"ctime_width", sizeof(double)}, {"hash_width", sizeof(uint32_t)},
    {"next_width", sizeof(int32_t)}, {"gen_width", sizeof(uint32_t)}, {"writer_width", sizeof(int32_t)},
    {"extent_width", sizeof(int32_t)}, {"nblobs_width", sizeof(uint32_t)}, {"keylen_width", sizeof(uint16_t)},
    {"session_width", sizeof(uint16_t)}, {"state_width", sizeof(uint8_t)}, {"kind_width", sizeof(uint8_t)},
    {"level_width", sizeof(uint8_t)}, {"flags_width", sizeof(uint8_t)}, {"bucket_width", sizeof(int32_t)},
    {"stats_used_width", sizeof(int64_t)}, {"stats_objects_width", sizeof(int64_t)}};

/* Return codes, the same as fastpath.codes on the Python side. */
enum { RC_MISSING = -1, RC_BUSY = -2, RC_OWNER_DEAD = -3, RC_BEING_WRITTEN = -4, RC_EXISTS = -5, RC_STOLEN = -6,
       RC_NO_ENTRY = -7, RC_NO_CUT = -8, RC_ERROR = -100 /* an exception is set: the call returns NULL */ };
static int configured;
static uint32_t crc_table[256];

/* One value of layout.fast_path_layout()'s dict; -1 with an exception set when missing. */
static Py_ssize_t setting(PyObject *d, const char *name) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "fast path layout lacks %s", name);
        return -1;
    }
    return PyLong_AsSsize_t(v);
}

/* configure(layout): offsets and constants by name, from layout.fast_path_layout(). */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *d;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d))
        return NULL;
    struct { const char *name; Py_ssize_t *dst; } offs[] = {
        {"entry_size", &ENTRY_SIZE}, {"hash_off", &HASH_OFF}, {"next_off", &NEXT_OFF}, {"keylen_off", &KEYLEN_OFF},
        {"session_off", &SESSION_OFF}, {"state_off", &STATE_OFF}, {"key_off", &KEY_OFF}, {"array_off", &ARRAY_OFF},
        {"stats_objects_off", &STATS_OBJECTS_OFF}, {"offset_off", &OFFSET_OFF}, {"nbytes_off", &NBYTES_OFF},
        {"atime_off", &ATIME_OFF}, {"gen_off", &GEN_OFF}, {"kind_off", &KIND_OFF}, {"level_off", &LEVEL_OFF},
        {"max_key", &MAX_KEY}, {"writer_off", &WRITER_OFF}, {"size_off", &SIZE_OFF}, {"ctime_off", &CTIME_OFF},
        {"extent_off", &EXTENT_OFF}, {"nblobs_off", &NBLOBS_OFF}, {"flags_off", &FLAGS_OFF},
        {"array_size", &ARRAY_SIZE}, {"bucket_width", &BUCKET_WIDTH}, {"stats_used_off", &STATS_USED_OFF},
        {"stats_used_width", &STATS_USED_WIDTH}, {"stats_objects_width", &STATS_OBJECTS_WIDTH},
        {"stripe_shift", &STRIPE_SHIFT}};
    for (size_t i = 0; i < sizeof WIDTHS / sizeof WIDTHS[0]; i++) {
        Py_ssize_t w = setting(d, WIDTHS[i].name);
        if (w < 0)
            return NULL;
        if (w != WIDTHS[i].width) {
            PyErr_Format(PyExc_ValueError, "the layout's %s is %zd bytes, _fast.c stores it in %zd: rebuild the "
                         "extension from this source (python setup.py build_ext --inplace) or set "
                         "SHMSTORE_PURE_PYTHON=1", WIDTHS[i].name, w, WIDTHS[i].width);
            return NULL;
        }
    }
    configured = 0;
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++)
        if ((*offs[i].dst = setting(d, offs[i].name)) < 0)
            return NULL;
    struct { const char *name; long *dst; } consts[] = {
        {"sealed", &SEALED}, {"writing", &WRITING}, {"deleted", &DELETED}, {"reserved", &RESERVED}};
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if ((*consts[i].dst = (long)setting(d, consts[i].name)) < 0)
            return NULL;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
    configured = 1;
    Py_RETURN_NONE;
}

/* zlib.crc32(data, seed): the key hash of table.py. */
static uint32_t crc32_seeded(uint32_t seed, const unsigned char *p, Py_ssize_t n) {
    uint32_t c = ~seed;
    while (n-- > 0)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

/* Walk bucket b's chain for key: the 0-based entry index, or -1. */
static Py_ssize_t find(char *base, Py_ssize_t buckets, Py_ssize_t entries, Py_ssize_t b, unsigned long h,
                       unsigned long sid, const char *key, Py_ssize_t klen, Py_ssize_t *eoff_out) {
    int32_t rec;
    memcpy(&rec, base + buckets + BUCKET_WIDTH * b, sizeof rec);
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

/* The repair of a lock taken from a dead holder, where the caller does not name it: set_repairer(fn) from
 * lock.py, fn(address) runs the on_recover of the ShmLock at that address (nothing where there is none). */
static PyObject *repairer = NULL;

/* set_repairer(fn) -> None */
static PyObject *set_repairer(PyObject *self, PyObject *fn) {
    Py_XSETREF(repairer, Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* fn(arg), or fn() where arg is NULL: the repair of a lock this thread took from a dead holder. 0, or -1 with
 * its exception set. Python may raise an asynchronous exception (a signal handler's) at the repair's first
 * instruction, before it repaired anything, and nobody else would (the lock is consistent again): where the
 * repair raised, it runs once more (a repair is idempotent), and the first exception is raised after. */
static int run_repair(PyObject *fn, PyObject *arg) {
    for (int attempt = 0; attempt < 2; attempt++) {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        if (attempt)
            PyErr_Fetch(&type, &value, &tb);
        PyObject *r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
        Py_XDECREF(r);
        if (attempt) {
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
        } else if (r != NULL) {
            return 0;
        }
    }
    return -1;
}

/* recover(lock, fn) -> None: the lock at address ``lock``, which this thread took from a dead holder
 * (EOWNERDEAD), made consistent and repaired (fn(), unless fn is None) in one call, and left held: ShmLock's
 * acquire, where nothing can land between the two steps. */
static PyObject *recover(PyObject *self, PyObject *args) {
    unsigned long long lock;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "KO", &lock, &fn))
        return NULL;
    pthread_mutex_consistent((pthread_mutex_t *)(uintptr_t)lock);
    if (fn != Py_None && run_repair(fn, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Take a robust mutex without waiting: 0 taken, RC_BUSY, or RC_OWNER_DEAD when its holder died: then it was
 * made consistent, repaired (the repairer) and released again, here, and the caller did nothing (it goes the
 * general way). RC_ERROR, with the repair's exception set, where the repair raised (the lock released all
 * the same). Once a C call returns to Python, Python may raise an asynchronous exception (a signal handler's)
 * before the caller's next line: a lock handed back held for the caller to repair stayed held for good by a
 * thread that lives on (issue 36's CI: "lock stripe 58 is held by this very thread"). */
static int try_take(pthread_mutex_t *m) {
    int rc = pthread_mutex_trylock(m);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        int failed = 0;
        if (repairer != NULL) {
            PyObject *addr = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)m);
            failed = addr == NULL || run_repair(repairer, addr) < 0;
            Py_XDECREF(addr);
        }
        pthread_mutex_unlock(m);
        return failed ? RC_ERROR : RC_OWNER_DEAD;
    }
    return rc ? RC_BUSY : 0;
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

/* Store a value of type T at byte offset off of entry e. */
#define PUT(e, off, T, v) do { T v_ = (T)(v); memcpy((e) + (off), &v_, sizeof v_); } while (0)

/* The fields of an entry that insert and put_small write. */
typedef struct {
    uint64_t offset, size, nbytes;
    double ctime, atime;
    uint32_t h, gen, nblobs;
    int32_t writer, extent;
    uint16_t klen, sid;
    uint8_t kind, level, flags;
} Fields;

/* Write reserved entry e (index idx) field by field, its ENTRY_ARRAY bytes (ab, may be empty) and key, count it
 * in its stripe's record ``st`` and link it at the head of bucket b, then give it ``state`` (the stripe lock
 * held). */
static void write_and_link(char *base, Py_ssize_t buckets, Py_ssize_t b, Py_ssize_t idx, char *e, const Fields *f,
                           const char *key, const Py_buffer *ab, char *st, long state) {
    /* each field on its own: no zeroing first, which another process's unlocked read (an
     * allocator repair reading this entry's extent) could see as a 0 */
    PUT(e, OFFSET_OFF, uint64_t, f->offset);
    PUT(e, SIZE_OFF, uint64_t, f->size);
    PUT(e, NBYTES_OFF, uint64_t, f->nbytes);
    PUT(e, ATIME_OFF, double, f->atime);
    PUT(e, CTIME_OFF, double, f->ctime);
    PUT(e, HASH_OFF, uint32_t, f->h);
    PUT(e, GEN_OFF, uint32_t, f->gen);
    PUT(e, WRITER_OFF, int32_t, f->writer);
    PUT(e, EXTENT_OFF, int32_t, f->extent);
    PUT(e, NBLOBS_OFF, uint32_t, f->nblobs);
    PUT(e, KEYLEN_OFF, uint16_t, f->klen);
    PUT(e, SESSION_OFF, uint16_t, f->sid);
    PUT(e, KIND_OFF, uint8_t, f->kind);
    PUT(e, LEVEL_OFF, uint8_t, f->level);
    PUT(e, FLAGS_OFF, uint8_t, f->flags);
    /* writing until linked: sealed and not in a chain is what a delete killed half way
     * leaves, so nothing else may ever look like that (list() shows sealed entries) */
    PUT(e, STATE_OFF, uint8_t, WRITING);
    if (ab->buf)
        memcpy(e + ARRAY_OFF, ab->buf, (size_t)ab->len);
    memcpy(e + KEY_OFF, key, (size_t)f->klen);
    int64_t used, objects;
    char *used_at = st + STATS_USED_OFF + STATS_USED_WIDTH * f->level, *head = base + buckets + BUCKET_WIDTH * b;
    memcpy(&used, used_at, sizeof used);
    memcpy(&objects, st + STATS_OBJECTS_OFF, sizeof objects);
    used += (int64_t)f->size;
    objects += 1;
    memcpy(used_at, &used, sizeof used);
    memcpy(st + STATS_OBJECTS_OFF, &objects, sizeof objects);
    int32_t first, rec = (int32_t)(idx + 1);
    memcpy(&first, head, sizeof first);
    memcpy(e + NEXT_OFF, &first, sizeof first);
    memcpy(head, &rec, sizeof rec); /* the publishing store, after the entry is whole */
    ((volatile char *)e)[STATE_OFF] = (char)state; /* sealed now, if asked */
}

/* Whether entry e is still reserved for ``writer`` with generation ``gen`` (not taken by another client: see
 * cache.py); asked under a lock the taker holds too. */
static int owns(const char *e, unsigned long gen, long writer) {
    uint32_t have_gen;
    int32_t have_writer;
    memcpy(&have_gen, e + GEN_OFF, 4);
    memcpy(&have_writer, e + WRITER_OFF, 4);
    return (unsigned char)e[STATE_OFF] == RESERVED && have_gen == gen && have_writer == writer;
}

static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* insert(meta, buckets, entries, b, h, sid, key, lock, idx, gen, writer, offset, size, nbytes, ctime, extent,
 *        nblobs, kind, flags, state, array, stats, level[, data, dst, held]) -> (code, creation time written):
 *   0 when entry idx is written field by field (at the offsets configure() was given; every other field of
 *   the head 0), its ENTRY_ARRAY bytes copied from ``array`` (or None), keyed, counted in its stripe (stats:
 *   that stripe's record; ``size`` bytes on ``level``) and linked at the head of bucket b, then given
 *   ``state``; RC_BUSY/RC_OWNER_DEAD as try_take; RC_BEING_WRITTEN or RC_EXISTS when the key is being
 *   written or exists; RC_STOLEN when entry idx is no longer reserved for ``writer`` with generation
 *   ``gen`` (another client took it from this one's batch: see cache.py). With ``data`` (a contiguous
 *   buffer), its bytes are first copied to address ``dst`` (space this writer owns, not yet visible), so
 *   a ``state`` of SEALED publishes a whole object in one call. With ``held`` true the caller holds the
 *   stripe lock (a batch: one hold for a group of keys): it is neither taken nor released here, and the
 *   creation time is ``ctime`` (read under that hold); else the clock is read once the lock is taken. */
static PyObject *insert(PyObject *self, PyObject *args) {
    unsigned long long meta, lock, stats, offset, size, nbytes, dst = 0;
    int held = 0; /* the caller holds the stripe lock (a batch holding it for a group of keys) */
    Py_ssize_t buckets, entries, b, klen, idx, level;
    unsigned long h, sid, gen, nblobs;
    long writer, extent, kind, flags, state;
    double ctime;
    const char *key;
    PyObject *array, *data = Py_None;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_fast.configure() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Knnnkky#KnklKKKdlklllOKn|OKp", &meta, &buckets, &entries, &b, &h, &sid, &key,
                          &klen, &lock, &idx, &gen, &writer, &offset, &size, &nbytes, &ctime, &extent, &nblobs,
                          &kind, &flags, &state, &array, &stats, &level, &data, &dst, &held))
        return NULL;
    if (data != Py_None) {
        Py_buffer db;
        if (PyObject_GetBuffer(data, &db, PyBUF_ANY_CONTIGUOUS) < 0)
            return NULL;
        if (db.len)
            memcpy((char *)(uintptr_t)dst, db.buf, (size_t)db.len);
        PyBuffer_Release(&db);
    }
    Py_buffer ab = {0};
    if (array != Py_None && PyObject_GetBuffer(array, &ab, PyBUF_SIMPLE) < 0)
        return NULL;
    if (ab.buf && ab.len > ARRAY_SIZE) {
        PyBuffer_Release(&ab);
        PyErr_Format(PyExc_ValueError, "array metadata of %zd bytes, the entry holds %zd", ab.len, ARRAY_SIZE);
        return NULL;
    }
    double atime = clock_seconds(CLOCK_MONOTONIC); /* time.monotonic()'s clock */
    pthread_mutex_t *m = (pthread_mutex_t *)(uintptr_t)lock;
    int rc = held ? 0 : try_take(m);
    if (rc == 0 && !held)
        ctime = clock_seconds(CLOCK_REALTIME); /* under the lock: a key's objects on a node are created in the
                                                * order they become visible (the cluster's versions compare) */
    if (rc == 0) {
        char *base = (char *)(uintptr_t)meta;
        Py_ssize_t found_off = 0;
        char *e = base + entries + idx * ENTRY_SIZE;
        if (find(base, buckets, entries, b, h, sid, key, klen, &found_off) >= 0) {
            rc = (unsigned char)base[found_off + STATE_OFF] == WRITING ? RC_BEING_WRITTEN : RC_EXISTS;
        } else if (!owns(e, gen, writer)) {
            rc = RC_STOLEN;
        } else {
            Fields f = {offset, size, nbytes, ctime, atime, (uint32_t)h, (uint32_t)gen, (uint32_t)nblobs,
                        (int32_t)writer, (int32_t)extent, (uint16_t)klen, (uint16_t)sid, (uint8_t)kind,
                        (uint8_t)level, (uint8_t)flags};
            write_and_link(base, buckets, b, idx, e, &f, key, &ab, (char *)(uintptr_t)stats, state);
        }
        if (!held)
            pthread_mutex_unlock(m);
    }
    if (ab.buf)
        PyBuffer_Release(&ab);
    if (rc == RC_ERROR)
        return NULL;
    return Py_BuildValue("(id)", rc, ctime);
}

/* set_byte(lock, addr, value) -> 0 once *addr = value under the lock, else RC_BUSY/RC_OWNER_DEAD as try_take. */
static PyObject *set_byte(PyObject *self, PyObject *args) {
    unsigned long long lock, addr;
    int value;
    if (!PyArg_ParseTuple(args, "KKi", &lock, &addr, &value))
        return NULL;
    pthread_mutex_t *m = (pthread_mutex_t *)(uintptr_t)lock;
    int rc = try_take(m);
    if (rc == RC_ERROR)
        return NULL;
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
/* One local pin less on idx: 1 when it was this process's last (its pin byte cleared),
 * 0 when not (or there was none), -1 with an exception set. */
static int drop_pin(PyObject *pins, Py_ssize_t idx, unsigned long long pins_addr) {
    PyObject *k = PyLong_FromSsize_t(idx);
    if (k == NULL)
        return -1;
    PyObject *n = PyDict_GetItemWithError(pins, k);
    if (n == NULL) {
        Py_DECREF(k);
        return PyErr_Occurred() ? -1 : 0;
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
        return -1;
    return count > 0 ? 0 : 1;
}

static PyObject *unpin(PyObject *self, PyObject *args) {
    PyObject *pins;
    Py_ssize_t idx;
    unsigned long long pins_addr;
    if (!PyArg_ParseTuple(args, "O!nK", &PyDict_Type, &pins, &idx, &pins_addr))
        return NULL;
    int last = drop_pin(pins, idx, pins_addr);
    if (last < 0)
        return NULL;
    return PyBool_FromLong(last);
}

/* A kernel's constants for get_entry/release, in a capsule (one per Kernel). */
typedef struct {
    char *meta;
    Py_ssize_t buckets, entries;
    unsigned long bmask, smask, sid;
    pthread_mutex_t **stripes;
    Py_ssize_t nstripes;
    unsigned long long pins_addr;
    PyObject *pins; /* the kernel's dict: entry index -> local pins (a strong reference) */
    double grain;
    /* what delete() needs besides (set by delete_config; 0 until then: delete() declines) */
    int del_ready;
    long slot, flag_moving, flag_in_chunk;
    unsigned long long stats_addr, pins_base, slots_high_addr;
    Py_ssize_t stats_size, deleted_off, pinrow, head_size;
    /* what put_small needs besides (set by put_config; 0 until then: put_small declines) */
    int put_ready;
    char *arena;            /* the arena's base address */
    const char *chunk_rec;  /* this client's record of its current chunk (the i32 extent record, 0: none) */
    long level;             /* the memory level's number */
} Ctx;

static void ctx_free(PyObject *capsule) {
    Ctx *c = PyCapsule_GetPointer(capsule, "shmstore.ctx");
    if (c == NULL)
        return;
    Py_XDECREF(c->pins);
    PyMem_Free(c->stripes);
    PyMem_Free(c);
}

/* context(meta, buckets, entries, bmask, smask, sid, stripe_addrs, pins_addr, pins, atime_grain) -> capsule */
static PyObject *context(PyObject *self, PyObject *args) {
    unsigned long long meta, pins_addr;
    Py_ssize_t buckets, entries;
    unsigned long bmask, smask, sid;
    PyObject *stripes, *pins;
    double grain;
    if (!PyArg_ParseTuple(args, "KnnkkkO!KO!d", &meta, &buckets, &entries, &bmask, &smask, &sid, &PyTuple_Type,
                          &stripes, &pins_addr, &PyDict_Type, &pins, &grain))
        return NULL;
    Ctx *c = PyMem_Calloc(1, sizeof(Ctx));
    if (c == NULL)
        return PyErr_NoMemory();
    c->nstripes = PyTuple_GET_SIZE(stripes);
    c->stripes = PyMem_Calloc(c->nstripes ? c->nstripes : 1, sizeof(pthread_mutex_t *));
    if (c->stripes == NULL) {
        PyMem_Free(c);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < c->nstripes; i++) {
        c->stripes[i] = (pthread_mutex_t *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(stripes, i));
        if (PyErr_Occurred()) {
            PyMem_Free(c->stripes);
            PyMem_Free(c);
            return NULL;
        }
    }
    if ((Py_ssize_t)smask + 1 != c->nstripes) {
        PyMem_Free(c->stripes);
        PyMem_Free(c);
        PyErr_SetString(PyExc_ValueError, "stripe mask does not match the stripe addresses");
        return NULL;
    }
    c->meta = (char *)(uintptr_t)meta;
    c->buckets = buckets;
    c->entries = entries;
    c->bmask = bmask;
    c->smask = smask;
    c->sid = sid;
    c->pins_addr = pins_addr;
    c->grain = grain;
    Py_INCREF(pins);
    c->pins = pins;
    PyObject *cap = PyCapsule_New(c, "shmstore.ctx", ctx_free);
    if (cap == NULL) {
        Py_DECREF(pins);
        PyMem_Free(c->stripes);
        PyMem_Free(c);
    }
    return cap;
}

/* The start of get_entry, has, read_small and delete: take the stripe lock of ``key`` (a str) without waiting and
 * find its sealed entry. Returns the held lock, with *cp, *idx (-1: no sealed entry) and *eoff set; or NULL,
 * with *early what the caller returns at once: NULL (an exception is set), None (a key this path does not
 * take) or an RC code (the lock was busy, or its holder died). */
static pthread_mutex_t *find_locked(PyObject *cap, PyObject *key, Ctx **cp, Py_ssize_t *idx, Py_ssize_t *eoff,
                                    PyObject **early) {
    *early = NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_fast.configure() was not called");
        return NULL;
    }
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    Py_ssize_t klen;
    const char *kb = PyUnicode_AsUTF8AndSize(key, &klen);
    if (kb == NULL || klen <= 0 || klen > MAX_KEY) {
        PyErr_Clear();
        *early = Py_NewRef(Py_None);
        return NULL;
    }
    unsigned long h = crc32_seeded((uint32_t)c->sid, (const unsigned char *)kb, klen);
    Py_ssize_t b = (Py_ssize_t)(h & c->bmask);
    pthread_mutex_t *m = c->stripes[(b >> STRIPE_SHIFT) & c->smask]; /* (layout.STRIPE_SHIFT) */
    int rc = try_take(m);
    if (rc) {
        *early = rc == RC_ERROR ? NULL : PyLong_FromLong(rc);
        return NULL;
    }
    *eoff = 0;
    *idx = find(c->meta, c->buckets, c->entries, b, h, c->sid, kb, klen, eoff);
    if (*idx >= 0 && (unsigned char)(c->meta + *eoff)[STATE_OFF] != SEALED)
        *idx = -1;
    *cp = c;
    return m;
}

/* find_locked for get_entry, read_small and delete, which answer RC_MISSING where the key has no sealed entry:
 * NULL then too, the lock released and *early that code. */
static pthread_mutex_t *find_sealed_locked(PyObject *cap, PyObject *key, Ctx **cp, Py_ssize_t *idx,
                                           Py_ssize_t *eoff, PyObject **early) {
    pthread_mutex_t *m = find_locked(cap, key, cp, idx, eoff, early);
    if (m != NULL && *idx < 0) {
        pthread_mutex_unlock(m);
        *early = PyLong_FromLong(RC_MISSING);
        return NULL;
    }
    return m;
}

/* Refresh entry e's access time (the stripe lock held) when it is older than the grain: what LRU needs. */
static void touch(const Ctx *c, char *e) {
    double atime, now = clock_seconds(CLOCK_MONOTONIC); /* time.monotonic()'s clock */
    memcpy(&atime, e + ATIME_OFF, 8);
    if (now - atime > c->grain)
        memcpy(e + ATIME_OFF, &now, 8);
}

/* get_entry(ctx, key) -> (idx, gen, offset, level, nbytes, kind, eoff) of the sealed entry of
 * key, pinned for this process, its access time refreshed when older than the grain;
 * RC_MISSING when there is none, RC_BUSY when its stripe lock is busy, RC_OWNER_DEAD when
 * that lock's holder died (repaired and released again: see try_take; the caller goes the general way);
 * None for a key this path does not take (not UTF-8, empty or too long). */
static PyObject *get_entry(PyObject *self, PyObject *args) {
    PyObject *cap, *key, *early;
    if (!PyArg_ParseTuple(args, "OU", &cap, &key))
        return NULL;
    Ctx *c = NULL;
    Py_ssize_t idx = -1, eoff = 0;
    pthread_mutex_t *m = find_sealed_locked(cap, key, &c, &idx, &eoff, &early);
    if (m == NULL)
        return early;
    if (count_pin(c->pins, idx, c->pins_addr) < 0) {
        pthread_mutex_unlock(m);
        return NULL;
    }
    char *e = c->meta + eoff;
    uint64_t off, nbytes;
    uint32_t gen;
    memcpy(&off, e + OFFSET_OFF, 8);
    memcpy(&nbytes, e + NBYTES_OFF, 8);
    memcpy(&gen, e + GEN_OFF, 4);
    int kind = (unsigned char)e[KIND_OFF], level = (unsigned char)e[LEVEL_OFF];
    touch(c, e);
    pthread_mutex_unlock(m);
    return Py_BuildValue("(nkKiKin)", idx, (unsigned long)gen, (unsigned long long)off, level,
                         (unsigned long long)nbytes, kind, eoff);
}

/* has(ctx, key) -> 1 when key has a sealed entry, 0 when it has none (RC codes are negative); RC_BUSY /
 * RC_OWNER_DEAD as get_entry; None for a key this path does not take. The test a fetch makes first (is it
 * here already?) without a pin and in one call. */
static PyObject *has(PyObject *self, PyObject *args) {
    PyObject *cap, *key, *early;
    if (!PyArg_ParseTuple(args, "OU", &cap, &key))
        return NULL;
    Ctx *c = NULL;
    Py_ssize_t idx = -1, eoff = 0;
    pthread_mutex_t *m = find_locked(cap, key, &c, &idx, &eoff, &early);
    if (m == NULL)
        return early;
    pthread_mutex_unlock(m);
    return PyLong_FromLong(idx >= 0);
}

/* read_small(ctx, key, max_bytes, arena_addr, memory_level, array_kind, array_len) ->
 *   (kind, nbytes, nblobs, array, data) of the sealed entry of key when it lies in memory (level
 *   memory_level, at arena_addr + its offset) and holds at most max_bytes: data its bytes, array its
 *   array_len ENTRY_ARRAY bytes where kind is array_kind (else None), copied under the stripe lock, which
 *   every delete and every move of the object takes first (so no pin is needed); its access time refreshed
 *   as get_entry does. 0 when it lies elsewhere or is larger (the caller goes the general way); RC_MISSING
 *   when there is none; RC_BUSY/RC_OWNER_DEAD as get_entry; None for a key this path does not take. A node
 *   service answers a remote read of a small object with it: one call, no lease. */
static PyObject *read_small(PyObject *self, PyObject *args) {
    PyObject *cap, *key, *early;
    unsigned long long max_bytes, arena;
    int memory_level, array_kind;
    Py_ssize_t array_len;
    if (!PyArg_ParseTuple(args, "OUKKiin", &cap, &key, &max_bytes, &arena, &memory_level, &array_kind,
                          &array_len))
        return NULL;
    Ctx *c = NULL;
    Py_ssize_t idx = -1, eoff = 0;
    pthread_mutex_t *m = find_sealed_locked(cap, key, &c, &idx, &eoff, &early);
    if (m == NULL)
        return early;
    char *e = c->meta + eoff;
    uint64_t off, nbytes;
    uint32_t nblobs;
    memcpy(&off, e + OFFSET_OFF, 8);
    memcpy(&nbytes, e + NBYTES_OFF, 8);
    memcpy(&nblobs, e + NBLOBS_OFF, 4);
    int kind = (unsigned char)e[KIND_OFF], level = (unsigned char)e[LEVEL_OFF];
    if (level != memory_level || nbytes > max_bytes) {
        pthread_mutex_unlock(m);
        return PyLong_FromLong(0);
    }
    PyObject *data = PyBytes_FromStringAndSize(nbytes ? (const char *)(uintptr_t)(arena + off) : "",
                                               (Py_ssize_t)nbytes);
    PyObject *array = kind == array_kind ? PyBytes_FromStringAndSize(e + ARRAY_OFF, array_len) : Py_NewRef(Py_None);
    touch(c, e);
    pthread_mutex_unlock(m);
    if (data == NULL || array == NULL) {
        Py_XDECREF(data);
        Py_XDECREF(array);
        return NULL;
    }
    return Py_BuildValue("(iKkNN)", kind, (unsigned long long)nbytes, (unsigned long)nblobs, array, data);
}

/* release(ctx, idx) -> 0 when this process still pins idx, 1 when that was its last pin,
 * 2 when it was the last and the entry is deleted (the caller frees it). */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *cap;
    Py_ssize_t idx;
    if (!PyArg_ParseTuple(args, "On", &cap, &idx))
        return NULL;
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    int last = drop_pin(c->pins, idx, c->pins_addr);
    if (last < 0)
        return NULL;
    if (!last)
        return PyLong_FromLong(0);
    int deleted = (unsigned char)c->meta[c->entries + idx * ENTRY_SIZE + STATE_OFF] == DELETED;
    return PyLong_FromLong(deleted ? 2 : 1);
}

/* delete_config(ctx, slot, stats_addr, stats_size, deleted_off, pins_base, pinrow, slots_high_addr,
 *               flag_moving, flag_in_chunk, head_size) -> None: what delete() needs to know of this client and
 * the layout (the stripe records' address and size, the offset of their count of deleted entries, the pin
 * table's address and row size, the address of the count of client slots ever taken, the entry flag values,
 * the size of an entry's head record). */
static PyObject *delete_config(PyObject *self, PyObject *args) {
    PyObject *cap;
    long slot, flag_moving, flag_in_chunk;
    unsigned long long stats_addr, pins_base, slots_high_addr;
    Py_ssize_t stats_size, deleted_off, pinrow, head_size;
    if (!PyArg_ParseTuple(args, "OlKnnKnKlln", &cap, &slot, &stats_addr, &stats_size, &deleted_off, &pins_base,
                          &pinrow, &slots_high_addr, &flag_moving, &flag_in_chunk, &head_size))
        return NULL;
    if (head_size <= STATE_OFF || head_size > 256 || head_size > ENTRY_SIZE) {
        PyErr_Format(PyExc_ValueError, "entry head of %zd bytes", head_size);
        return NULL;
    }
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    c->slot = slot;
    c->stats_addr = stats_addr;
    c->stats_size = stats_size;
    c->deleted_off = deleted_off;
    c->pins_base = pins_base;
    c->pinrow = pinrow;
    c->slots_high_addr = slots_high_addr;
    c->flag_moving = flag_moving;
    c->flag_in_chunk = flag_in_chunk;
    c->head_size = head_size;
    c->del_ready = 1;
    Py_RETURN_NONE;
}

static void add_i64(char *at, int64_t n) {
    int64_t v;
    memcpy(&v, at, sizeof v);
    v += n;
    memcpy(at, &v, sizeof v);
}

/* delete(ctx, key) -> the steps of Kernel.delete for the common cases, in the same order, under the key's
 * stripe lock, in one call:
 *   (idx, gen): the sealed entry of key was pinned by no process, not moving and cut from a chunk: hidden,
 *       unlinked, uncounted and reserved again for this client with generation gen (the caller puts
 *       (idx, gen) back in its ClientSupply, as NodeStore.release does);
 *   1: it was pinned or moving: hidden and unlinked; its last pin (or the mover) frees it;
 *   0: it lies outside any chunk: nothing done, the caller goes the general way (which frees its space);
 *   RC_MISSING: no sealed entry; RC_BUSY/RC_OWNER_DEAD as get_entry; None for a key this path does not take.
 * A process killed in between leaves what the Python steps leave (a deleted entry in its chain, or one out
 * of every chain), which the stripe's repair mends. */
static PyObject *delete(PyObject *self, PyObject *args) {
    PyObject *cap, *key, *early;
    if (!PyArg_ParseTuple(args, "OU", &cap, &key))
        return NULL;
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    if (!c->del_ready)
        Py_RETURN_NONE;
    Py_ssize_t idx = -1, eoff = 0;
    pthread_mutex_t *m = find_sealed_locked(cap, key, &c, &idx, &eoff, &early);
    if (m == NULL)
        return early;
    char *e = c->meta + eoff;
    int flags = (unsigned char)e[FLAGS_OFF];
    uint32_t slots_high, h;
    memcpy(&slots_high, (const char *)(uintptr_t)c->slots_high_addr, sizeof slots_high);
    const volatile char *pin = (const volatile char *)(uintptr_t)(c->pins_base + (unsigned long long)idx);
    int pinned = 0;
    for (uint32_t s = 0; s < slots_high && !pinned; s++)
        pinned = pin[(Py_ssize_t)s * c->pinrow] != 0;
    int keep = !pinned && !(flags & c->flag_moving);
    if (keep && !(flags & c->flag_in_chunk)) {
        pthread_mutex_unlock(m);
        return PyLong_FromLong(0);
    }
    memcpy(&h, e + HASH_OFF, 4);
    Py_ssize_t b = (Py_ssize_t)(h & c->bmask);
    char *st = (char *)(uintptr_t)(c->stats_addr + (unsigned long long)(((b >> STRIPE_SHIFT) & c->smask) * c->stats_size));
    /* hidden first, then out of its chain (table.mark_deleted, table.unlink) */
    ((volatile char *)e)[STATE_OFF] = (char)DELETED;
    add_i64(st + c->deleted_off, 1);
    int32_t target = (int32_t)(idx + 1), nxt, rec;
    memcpy(&nxt, e + NEXT_OFF, 4);
    char *head = c->meta + c->buckets + BUCKET_WIDTH * b;
    memcpy(&rec, head, 4);
    if (rec == target) {
        memcpy(head, &nxt, 4);
    } else {
        while (rec) {
            char *p = c->meta + c->entries + (Py_ssize_t)(rec - 1) * ENTRY_SIZE;
            int32_t cur;
            memcpy(&cur, p + NEXT_OFF, 4);
            if (cur == target) {
                memcpy(p + NEXT_OFF, &nxt, 4);
                break;
            }
            rec = cur;
        }
    }
    if (!keep) {
        pthread_mutex_unlock(m);
        return PyLong_FromLong(1);
    }
    /* table.keep_entry: uncounted, then reserved for this client under a new generation: the whole head
     * written at once, every other field 0 (no extent, offset or chunk flag left naming the chunk) */
    uint64_t size;
    uint32_t gen;
    memcpy(&size, e + SIZE_OFF, 8);
    memcpy(&gen, e + GEN_OFF, 4);
    int level = (unsigned char)e[LEVEL_OFF];
    add_i64(st + STATS_USED_OFF + STATS_USED_WIDTH * level, -(int64_t)size);
    add_i64(st + STATS_OBJECTS_OFF, -1);
    add_i64(st + c->deleted_off, -1);
    gen += 1;
    char head_rec[256];
    memset(head_rec, 0, (size_t)c->head_size);
    PUT(head_rec, HASH_OFF, uint32_t, h);
    PUT(head_rec, GEN_OFF, uint32_t, gen);
    PUT(head_rec, WRITER_OFF, int32_t, c->slot);
    PUT(head_rec, STATE_OFF, uint8_t, RESERVED);
    memcpy(e, head_rec, (size_t)c->head_size);
    pthread_mutex_unlock(m);
    return Py_BuildValue("(nk)", idx, (unsigned long)gen);
}

/* put_config(ctx, arena_addr, chunk_rec_addr, level) -> None: what put_small needs (the arena's address, that
 * of this client's record of its current chunk, the memory level's number); after delete_config. */
static PyObject *put_config(PyObject *self, PyObject *args) {
    PyObject *cap;
    unsigned long long arena, chunk_rec;
    long level;
    if (!PyArg_ParseTuple(args, "OKKl", &cap, &arena, &chunk_rec, &level))
        return NULL;
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    if (!c->del_ready) {
        PyErr_SetString(PyExc_RuntimeError, "put_config() before delete_config()");
        return NULL;
    }
    c->arena = (char *)(uintptr_t)arena;
    c->chunk_rec = (const char *)(uintptr_t)chunk_rec;
    c->level = level;
    c->put_ready = 1;
    Py_RETURN_NONE;
}

/* put_small(ctx, key, h, data, array, kind, nbytes, nblobs, entries, cut) -> the whole put of a small value in
 * memory, as MemoryLevel.try_put does it in steps (cut, copy, insert, seal), in one call:
 *   (idx, gen, offset, stored, ctime, stripe) (a Reservation): ``data`` (a contiguous buffer, ``key``'s UTF-8
 *       bytes hashed to ``h``) was copied to the next ``stored`` = 64-aligned bytes of this client's current
 *       chunk (``cut``: int64 start, position and end of it, the position moved on) and the last entry of
 *       ``entries`` (this client's reserved (index, generation) pairs: popped, and any taken by another
 *       client meanwhile dropped) written, counted, linked and sealed under the key's stripe lock;
 *   RC_NO_CUT: the chunk lacks room (or this client has none); RC_NO_ENTRY: ``entries`` ran out: the caller
 *       gets more and calls again; RC_BUSY/RC_OWNER_DEAD as try_take; RC_BEING_WRITTEN/RC_EXISTS as insert;
 *   None: put_config was not called.
 * The caller holds the client's chunk lock: no thread of this process takes a new chunk meanwhile (and as the
 * GIL is held throughout, none sees the cut before its entry names the chunk). Nothing changes where no
 * entry is written, but bytes past the cut's position. */
static PyObject *put_small(PyObject *self, PyObject *args) {
    PyObject *cap, *data, *array, *entries, *cut;
    const char *key;
    Py_ssize_t klen;
    unsigned long h, nblobs;
    long kind;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "Oy#kOOlKkO!O", &cap, &key, &klen, &h, &data, &array, &kind, &nbytes, &nblobs,
                          &PyList_Type, &entries, &cut))
        return NULL;
    Ctx *c = PyCapsule_GetPointer(cap, "shmstore.ctx");
    if (c == NULL)
        return NULL;
    if (!c->put_ready)
        Py_RETURN_NONE;
    if (klen <= 0 || klen > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "key of %zd bytes", klen);
        return NULL;
    }
    Py_buffer db = {0}, ab = {0}, cb = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(data, &db, PyBUF_ANY_CONTIGUOUS) < 0)
        return NULL;
    if (array != Py_None && PyObject_GetBuffer(array, &ab, PyBUF_SIMPLE) < 0)
        goto done;
    if (ab.buf && ab.len > ARRAY_SIZE) {
        PyErr_Format(PyExc_ValueError, "array metadata of %zd bytes, the entry holds %zd", ab.len, ARRAY_SIZE);
        goto done;
    }
    if (PyObject_GetBuffer(cut, &cb, PyBUF_WRITABLE) < 0)
        goto done;
    if (cb.len < 3 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "cut holds fewer than 3 int64");
        goto done;
    }
    int64_t *cv = (int64_t *)cb.buf; /* start, position, end */
    int32_t chunk;
    memcpy(&chunk, c->chunk_rec, sizeof chunk);
    int64_t pos = cv[1], stored = ((int64_t)(db.len ? db.len : 1) + 63) & ~(int64_t)63; /* (layout.align) */
    if (!chunk || pos + stored > cv[2]) {
        result = PyLong_FromLong(RC_NO_CUT);
        goto done;
    }
    if (PyList_GET_SIZE(entries) == 0) {
        result = PyLong_FromLong(RC_NO_ENTRY);
        goto done;
    }
    if (db.len)
        memcpy(c->arena + pos, db.buf, (size_t)db.len); /* space this client owns, not yet named by an entry */
    double atime = clock_seconds(CLOCK_MONOTONIC);
    Py_ssize_t b = (Py_ssize_t)(h & c->bmask), stripe = (b >> STRIPE_SHIFT) & (Py_ssize_t)c->smask, found_off = 0;
    pthread_mutex_t *m = c->stripes[stripe];
    int rc = try_take(m);
    if (rc) {
        result = rc == RC_ERROR ? NULL : PyLong_FromLong(rc);
        goto done;
    }
    double ctime = clock_seconds(CLOCK_REALTIME); /* under the lock, as insert's */
    if (find(c->meta, c->buckets, c->entries, b, h, c->sid, key, klen, &found_off) >= 0) {
        rc = (unsigned char)c->meta[found_off + STATE_OFF] == WRITING ? RC_BEING_WRITTEN : RC_EXISTS;
        pthread_mutex_unlock(m);
        result = PyLong_FromLong(rc);
        goto done;
    }
    Py_ssize_t n, idx = -1;
    unsigned long gen = 0;
    while ((n = PyList_GET_SIZE(entries)) > 0) { /* the last one still ours (none is taken while we hold a stripe lock) */
        PyObject *held = PyList_GET_ITEM(entries, n - 1);
        if (!PyTuple_Check(held) || PyTuple_GET_SIZE(held) != 2) {
            pthread_mutex_unlock(m);
            PyErr_SetString(PyExc_TypeError, "entries holds (index, generation) pairs");
            goto done;
        }
        idx = PyLong_AsSsize_t(PyTuple_GET_ITEM(held, 0));
        gen = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(held, 1));
        if (PyErr_Occurred()) {
            pthread_mutex_unlock(m);
            goto done;
        }
        /* dropped from the list either way (a tuple of two ints: no finalizer runs) */
        if (PyList_SetSlice(entries, n - 1, n, NULL) < 0) {
            pthread_mutex_unlock(m);
            goto done;
        }
        if (owns(c->meta + c->entries + idx * ENTRY_SIZE, gen, c->slot))
            break;
        idx = -1; /* another client took it: the next one */
    }
    if (idx < 0) {
        pthread_mutex_unlock(m);
        result = PyLong_FromLong(RC_NO_ENTRY);
        goto done;
    }
    Fields f = {(uint64_t)pos, (uint64_t)stored, nbytes, ctime, atime, (uint32_t)h, (uint32_t)gen, (uint32_t)nblobs,
                (int32_t)c->slot, chunk, (uint16_t)klen, (uint16_t)c->sid, (uint8_t)kind, (uint8_t)c->level,
                (uint8_t)c->flag_in_chunk};
    write_and_link(c->meta, c->buckets, b, idx, c->meta + c->entries + idx * ENTRY_SIZE, &f, key, &ab,
                   (char *)(uintptr_t)(c->stats_addr + (unsigned long long)(stripe * c->stats_size)), SEALED);
    cv[1] = pos + stored;
    pthread_mutex_unlock(m);
    result = Py_BuildValue("(nkLLdn)", idx, gen, (long long)pos, (long long)stored, ctime, stripe);
done:
    if (cb.buf)
        PyBuffer_Release(&cb);
    if (ab.buf)
        PyBuffer_Release(&ab);
    PyBuffer_Release(&db);
    return result;
}

/* ---- LockBase: the two steps of a store lock that must run with no Python frame ----------------
 *
 * Python checks for asynchronous exceptions (a signal handler's, PyThreadState_SetAsyncExc) when a
 * Python function starts and after each call of a C function. A Python __exit__ or release() could
 * take one at its first instruction, before unlocking: the lock would stay held by a live thread.
 * These C methods unlock first (after the repair of a section left by an unexpected exception, which
 * the Python subclass decides in _abandon): nothing can come in between. __enter__ and acquire stay
 * Python: a Python function's return is not such a point, and their own C calls are inside a try
 * that unlocks. */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t *mutex;
} LockBase;

static int LockBase_init(LockBase *self, PyObject *args, PyObject *kwds) {
    unsigned long long addr;
    PyObject *rest = PyTuple_GetSlice(args, 0, 1);
    if (rest == NULL)
        return -1;
    int ok = PyArg_ParseTuple(rest, "K", &addr);
    Py_DECREF(rest);
    if (!ok)
        return -1;
    self->mutex = (pthread_mutex_t *)(uintptr_t)addr;
    return 0;
}

/* __exit__(exc_type, exc, tb): with an exception, self._abandon(exc_type) first (it repairs what an
 * unexpected one left half done; once more where it raised, as run_repair); then unlock, whatever _abandon
 * did. */
static PyObject *LockBase_exit(LockBase *self, PyObject *args) {
    PyObject *et = PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : Py_None;
    int failed = 0;
    if (et != Py_None) {
        PyObject *abandon = PyObject_GetAttrString((PyObject *)self, "_abandon");
        failed = abandon == NULL || run_repair(abandon, et) < 0;
        Py_XDECREF(abandon);
    }
    int rc = self->mutex ? pthread_mutex_unlock(self->mutex) : EINVAL;
    if (et != Py_None) {
        if (failed)
            return NULL;
    } else if (rc) {
        PyErr_Format(PyExc_RuntimeError, "release of a lock this thread does not hold (%d)", rc);
        return NULL;
    }
    Py_RETURN_FALSE;
}

/* release(): unlock (RuntimeError when this thread does not hold it). */
static PyObject *LockBase_release(LockBase *self, PyObject *unused) {
    int rc = self->mutex ? pthread_mutex_unlock(self->mutex) : EINVAL;
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "release of a lock this thread does not hold (%d)", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef LockBase_methods[] = {
    {"__exit__", (PyCFunction)LockBase_exit, METH_VARARGS, "Repair if needed (see _abandon), then unlock."},
    {"release", (PyCFunction)LockBase_release, METH_NOARGS, "Unlock."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LockBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstore.meta._fast.LockBase",
    .tp_basicsize = sizeof(LockBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The unlocking half of a store lock, in C (see lock.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LockBase_init,
    .tp_methods = LockBase_methods,
};

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the entry layout (from layout.fast_path_layout())."},
    {"insert", insert, METH_VARARGS, "Write, count and link a reserved entry under its stripe lock."},
    {"set_byte", set_byte, METH_VARARGS, "Store one byte under a lock (sealing an entry)."},
    {"set_repairer", set_repairer, METH_O, "fn(address): the repair of a lock taken from a dead holder."},
    {"recover", recover, METH_VARARGS, "Make a lock taken from a dead holder consistent and repair it."},
    {"pin", pin, METH_VARARGS, "One more local pin (stripe lock held)."},
    {"unpin", unpin, METH_VARARGS, "Drop one local pin; True when it was the last."},
    {"context", context, METH_VARARGS, "A kernel's constants for get_entry and release."},
    {"get_entry", get_entry, METH_VARARGS, "Find, pin and touch a sealed entry; its fields."},
    {"has", has, METH_VARARGS, "Whether a key has a sealed entry (no pin)."},
    {"read_small", read_small, METH_VARARGS, "A small object in memory, copied under its stripe lock."},
    {"release", release, METH_VARARGS, "Drop one local pin: 0, 1 (last) or 2 (last, entry deleted)."},
    {"delete_config", delete_config, METH_VARARGS, "What delete() needs of this client and the layout."},
    {"delete", delete, METH_VARARGS, "Hide, unlink and (unpinned, in a chunk) free a sealed entry in one call."},
    {"put_config", put_config, METH_VARARGS, "What put_small() needs of this client and its arena."},
    {"put_small", put_small, METH_VARARGS, "Cut, copy, insert and seal a small value in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) {
    if (PyType_Ready(&LockBaseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LockBaseType);
    if (PyModule_AddObject(m, "LockBase", (PyObject *)&LockBaseType) < 0) {
        Py_DECREF(&LockBaseType);
        Py_DECREF(m);
        return NULL;
    }
    /* what fastpath.ABI checks: raised with every change of a call's arguments or answer (a build older
     * than its source is not loaded) */
    if (PyModule_AddIntConstant(m, "ABI", 3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
