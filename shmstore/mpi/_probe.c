/* Waiting for an MPI message with the GIL released: the polling loop of shmstore.mpi (poll.py).
 *
 * A node's service must notice a request within microseconds while requests come in, and cost the
 * application nothing while none do: probe_wait calls MPI_Iprobe of the MPI library mpi4py loaded
 * (its address found by poll.py) back to back for a short window, then after naps that double up to a
 * limit, all with the GIL released. It touches no store; it lives apart from the kernel's fast path
 * (meta/_fast.c) so that the kernel knows nothing of MPI. Optional like the kernel's extensions:
 * where it is not built (or SHMSTORE_PURE_PYTHON is set) poll.py probes from Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <time.h>

typedef int (*iprobe_fn)(int source, int tag, intptr_t comm, int *flag, void *status);

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* probe_wait(iprobe_address, any_source, tag, comm_handle, spin_ns, nap_ns, max_ns[, nap_max_ns])
 * -> 1 when a message
 * with ``tag`` is waiting, 0 after max_ns without one, 2 when a signal cut a nap short (its Python handler
 * runs once this returns: a Ctrl-C raises at once), -rc when MPI_Iprobe failed.
 *
 * Calls MPI_Iprobe (its address from the loaded MPI library; the communicator handle is passed in a
 * register, an int for MPICH's ABI and a pointer for Open MPI's, both fit intptr_t) with the GIL released:
 * the application's Python threads never wait for a polling service. Probes back to back for spin_ns
 * (a short window), then after naps of nap_ns, each twice the last up to nap_max_ns (default nap_ns): a
 * long wait wakes rarely (seven ranks waiting on two cores with 20 us naps left no time to the transfer
 * they waited for). */
static PyObject *probe_wait(PyObject *self, PyObject *args) {
    unsigned long long addr, comm;
    int any, tag;
    long long spin_ns, nap_ns, max_ns, nap_max_ns = 0;
    if (!PyArg_ParseTuple(args, "KiiKLLL|L", &addr, &any, &tag, &comm, &spin_ns, &nap_ns, &max_ns, &nap_max_ns))
        return NULL;
    if (nap_max_ns < nap_ns)
        nap_max_ns = nap_ns;
    iprobe_fn iprobe = (iprobe_fn)(uintptr_t)addr;
    int flag = 0, rc = 0, interrupted = 0;
    char status[256]; /* larger than any MPI_Status */
    Py_BEGIN_ALLOW_THREADS
    int64_t start = mono_ns();
    struct timespec nap = {(time_t)(nap_ns / 1000000000), (long)(nap_ns % 1000000000)};
    int slack = -1; /* the thread's timer slack, while naps run with a tight one */
    for (;;) {
        rc = iprobe(any, tag, (intptr_t)(uintptr_t)comm, &flag, status);
        if (rc != 0 || flag)
            break;
        int64_t waited = mono_ns() - start;
        if (waited >= max_ns)
            break;
        if (waited < spin_ns)
            continue; /* no sched_yield: a yield per probe made replies come 4x later, at random, on a
                       * 2-core machine; the window is short */
        if (slack < 0 && nap_ns < 1000000) {
            /* Linux lets a 50 us sleep last 50 us more by default (a 20 us nap took 105 us here) */
            slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
            if (slack > 0)
                prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        }
        if (nanosleep(&nap, NULL) != 0 && errno == EINTR) {
            interrupted = 1; /* a signal for this thread: Python runs its handler when we return */
            break;
        }
        if (nap_ns < nap_max_ns) {
            nap_ns = nap_ns * 2 < nap_max_ns ? nap_ns * 2 : nap_max_ns;
            nap.tv_sec = (time_t)(nap_ns / 1000000000);
            nap.tv_nsec = (long)(nap_ns % 1000000000);
        }
    }
    if (slack > 0)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc != 0 ? -(long)(rc < 0 ? -rc : rc) : flag ? 1 : interrupted ? 2 : 0);
}

static PyMethodDef methods[] = {
    {"probe_wait", probe_wait, METH_VARARGS, "Wait for an MPI message with the GIL released (see above)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
