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
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef int (*iprobe_fn)(int source, int tag, intptr_t comm, int *flag, void *status);

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* This kernel's identity (FNV-1a of its boot_id, doorbell.kernel_id computes the same): a ring that carries it
 * came from a thread of this machine, whose CPU number it carries too. 0: unknown. */
static uint32_t kernel_id = 0;

static uint32_t read_kernel_id(void) {
    char buf[64] = {0};
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
        n--;
    if (n <= 0)
        return 0;
    uint32_t h = 2166136261u;
    for (ssize_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)buf[i]) * 16777619u;
    return h ? h : 1;
}

/* Take every ring waiting on the bell ``fd``: one wake-up answers them all. Returns how many came, and sets
 * *here where one came from a thread on the CPU this thread runs on (an 8-byte ring: kernel id, CPU). */
static int take_rings(int fd, int *here) {
    unsigned char buf[64];
    int count = 0, cpu = sched_getcpu();
    ssize_t n;
    while ((n = recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) {
        count++;
        if (n == 8 && kernel_id) {
            uint32_t kid, from;
            memcpy(&kid, buf, 4);
            memcpy(&from, buf + 4, 4);
            if (kid == kernel_id && cpu >= 0 && from == (uint32_t)cpu)
                *here = 1;
        }
    }
    return count;
}

/* Whether the last rings this thread took came from a thread on its own CPU, until rung_here() reads it. A ring
 * over the loopback or a veth pair wakes the sleeper on the ringing thread's CPU (the socket's wake-up is a
 * synchronous one), where that thread waits for the answer: the service's spin after it kept the asker off its
 * own core (traced: the ring's sendto returned 420-490 us later, the answer long sent). Told so, the service
 * naps at once after answering (service.py). Only threads with a bell (one service per process) set it. */
static int rung_from_here = 0;

/* Sleep ``ns`` nanoseconds, or less where the bell ``fd`` (>= 0) rings: 1 when rung (the rings taken), 0 when
 * the time passed, -1 when a signal cut it short. */
static int nap_or_ring(int fd, const struct timespec *nap) {
    if (fd < 0)
        return nanosleep(nap, NULL) != 0 && errno == EINTR ? -1 : 0;
    struct pollfd p = {fd, POLLIN, 0};
    int n = ppoll(&p, 1, nap, NULL);
    if (n < 0)
        return errno == EINTR ? -1 : 0;
    if (n > 0 && (p.revents & POLLIN)) {
        int here = 0;
        take_rings(fd, &here);
        rung_from_here = here;
        return 1;
    }
    if (n > 0) /* an error on the socket (closed under us): the nap's time, never a spin */
        nanosleep(nap, NULL);
    return 0;
}

/* Whether thread ``tid`` of this machine waits to run on CPU ``cpu`` (runnable there, while this thread runs on
 * it): read from /proc/<tid>/task/<tid>/stat (the thread's own state and last CPU; the process's file would add
 * up every thread's times), opened into *fd on the first look (-2: not yet; -1: it could not be) and read again
 * from its start (~4 us on a VM); the caller closes it. A thread that is gone waits nowhere. */
static __thread long partner_naps = 0; /* this thread's naps for its partner, for tests */

static int partner_waits_here(int *fd, int tid, int cpu) {
    if (*fd == -2) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/task/%d/stat", tid, tid);
        *fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (*fd < 0 || cpu < 0)
        return 0;
    char buf[1024];
    ssize_t n = pread(*fd, buf, sizeof buf - 1, 0);
    if (n <= 0) { /* gone: not looked at again in this wait */
        close(*fd);
        *fd = -1;
        return 0;
    }
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses: fields follow its last ')' */
    if (p == NULL || p[1] != ' ' || p[2] != 'R')
        return 0;
    p += 2;
    for (int field = 3; field < 39; p++) { /* field 3 is the state, 39 the CPU it last ran on */
        if (*p == 0)
            return 0;
        if (*p == ' ')
            field++;
    }
    return atoi(p) == cpu;
}

/* Whether a CPU other than this thread's could take it at once: the machine's runnable threads (the 4th field
 * of /proc/loadavg, counted now, this thread and its waiting partner included) leave one of the CPUs this
 * thread may run on without any. */
static int idle_cpu_elsewhere(int allowed) {
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = buf;
    for (int field = 0; field < 3; p++) { /* three load averages, then "running/total" */
        if (*p == 0)
            return 0;
        if (*p == ' ')
            field++;
    }
    long running = atol(p);
    return running > 0 && running - 2 < allowed - 1;
}

static __thread long partner_hops = 0; /* this thread's moves off its partner's CPU, for tests */
static int hop_allowed = 1; /* set_hop(): SHMSTORE_PARTNER_HOP, poll.prober sets it; 2 (tests): idle or not */

/* Move this thread off CPU ``cpu`` where its partner waits to run there and another CPU it may use idles: its
 * affinity without ``cpu`` (the kernel moves it at once), then its own again (a mask that holds the CPU it now
 * runs on moves nothing). 1 where it moved. A thread bound to one CPU (a launcher's binding) never moves. */
static int hop_off(int cpu) {
    cpu_set_t own, other;
    if (!hop_allowed)
        return 0;
    if (sched_getaffinity(0, sizeof own, &own) != 0 || CPU_COUNT(&own) < 2 || !CPU_ISSET(cpu, &own))
        return 0;
    if (hop_allowed == 1 && !idle_cpu_elsewhere(CPU_COUNT(&own)))
        return 0;
    other = own;
    CPU_CLR(cpu, &other);
    if (sched_setaffinity(0, sizeof other, &other) != 0)
        return 0;
    sched_setaffinity(0, sizeof own, &own);
    partner_hops++;
    return 1;
}

/* Naps shorter than a millisecond with a tight timer slack: Linux lets a 50 us sleep last 50 us more by default
 * (a 20 us nap took 105 us here). *slack keeps the thread's own (-1: not tightened yet), which probe_wait gives
 * back as it returns. */
static void tighten_slack(int *slack) {
    if (*slack >= 0)
        return;
    *slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (*slack > 0)
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
}

/* How often a spin looks whether its partner waits for this thread's CPU (see probe_wait's partner), and when
 * first: most replies come within 40 us of a spin's start, and a look costs ~4 us on a VM (looks from the
 * start every 20 us made back-to-back gets on nodes apart ~10 us slower at the median) */
#define PARTNER_LOOK_NS 20000
#define PARTNER_FIRST_NS 40000

/* A node service's request waits, and the application's main thread computes in Python: the service takes the
 * GIL only once the holder drops it, asked to after the switch interval (5 ms by default) of waiting, and again
 * after each MPI call of the request's handling (each gives the GIL away). probe_wait(urgent_us) lowers the
 * interval to urgent_us as it takes the GIL back, and gives the application's interval back as it lets the GIL
 * go for its next wait (give_back_switch_interval): lowered exactly while the service thread wants or holds the
 * GIL. Before Python 3.12 the interval is the runtime's, read and written without a thread state; later it is
 * the interpreter's, and poll.Urgency lowers it from Python instead (the first wait is the default's). Only a
 * node's service passes urgent_us, one thread per process. */
static unsigned long lowered_from_us = 0; /* the application's interval, while lowered here; 0: not lowered */
static unsigned long lowered_to_us = 0;

static void give_back_switch_interval(void) {
#if PY_VERSION_HEX < 0x030C0000
    if (lowered_from_us) {
        if (_PyEval_GetSwitchInterval() == lowered_to_us) /* else the application set its own meanwhile */
            _PyEval_SetSwitchInterval(lowered_from_us);
        lowered_from_us = 0;
    }
#endif
}

static void lower_switch_interval(unsigned long us) {
#if PY_VERSION_HEX < 0x030C0000
    unsigned long now = _PyEval_GetSwitchInterval();
    if (now > us) { /* an application's shorter interval stays */
        lowered_from_us = now;
        lowered_to_us = us;
        _PyEval_SetSwitchInterval(us);
    }
#else
    (void)us;
#endif
}

/* probe_wait(iprobe_address, any_source, tag, comm_handle, spin_ns, nap_ns, max_ns[, nap_max_ns, bell_fd,
 * ring_spin_ns, ring_nap_ns, ring_nap_max_ns, ring_window_ns, worked_ns, urgent_us, partner]) -> 1 when a
 * message with ``tag`` is waiting, 0 after max_ns without one, 2 when a signal cut a nap short (its Python
 * handler runs once this returns: a Ctrl-C raises at once), -rc when MPI_Iprobe failed.
 *
 * Calls MPI_Iprobe (its address from the loaded MPI library; the communicator handle is passed in a
 * register, an int for MPICH's ABI and a pointer for Open MPI's, both fit intptr_t) with the GIL released:
 * the application's Python threads never wait for a polling service. Probes back to back for spin_ns
 * (a short window), then after naps of nap_ns, each twice the last up to nap_max_ns (default nap_ns): a
 * long wait wakes rarely (seven ranks waiting on two cores with 20 us naps left no time to the transfer
 * they waited for).
 *
 * bell_fd (a node service's doorbell, doorbell.py; -1: none): every nap is a sleep on the bell too, so a
 * request whose sender rang is seen when the ring wakes this thread, not when the nap ends (on a VM a
 * 200 us nap lasts ~300 us, the wake-up by a ring ~70). A ring switches the wait to the ring's pace: it
 * probes at once, then back to back for ring_spin_ns, then after naps from ring_nap_ns doubling up to
 * ring_nap_max_ns, for at least ring_window_ns more (the ring may come before its message: over TCP the
 * two take different paths).
 *
 * worked_ns (> 0: a wait for a reply, never a service's idle loop): a probe that took longer than this moved
 * bytes, and the next follows at once instead of after a nap.
 *
 * partner (> 0): the id of the thread (of this machine, in this process-id namespace) that the awaited message
 * depends on: the service that will answer, the asker whose next request comes. Two such threads on one core
 * each spun their window while the other waited to run (emulated nodes of one host, where the scheduler woke
 * them side by side: traced, a service spun 333 us on the asker's core, the asker woken and waiting, the other
 * core idle). From 40 us into a spin, every 20 us, this looks whether the partner waits to run on this CPU. Where
 * it does and another CPU this thread may use idles, this thread moves there (hop_off: the kernel left the two
 * side by side for 60 gets in a row, ~30 ms, with a 20 us nap alone); else it naps 20 us and the partner runs.
 *
 * urgent_us (> 0: a node's service): the GIL's switch interval is the application's while this waits and
 * urgent_us from where it takes the GIL back (see lower_switch_interval), with a message or without: an idle
 * service that waited the default 5 ms for the GIL after each of its 10 ms sleeps was deaf to requests for up to
 * half of the time its rank computed in Python. */
static PyObject *probe_wait(PyObject *self, PyObject *args) {
    unsigned long long addr, comm;
    int any, tag, fd = -1;
    long long spin_ns, nap_ns, max_ns, nap_max_ns = 0;
    long long ring_spin_ns = 0, ring_nap_ns = 0, ring_nap_max_ns = 0, ring_window_ns = 0, worked_ns = 0;
    long long urgent_us = 0;
    int partner = 0;
    if (!PyArg_ParseTuple(args, "KiiKLLL|LiLLLLLLi", &addr, &any, &tag, &comm, &spin_ns, &nap_ns, &max_ns,
                          &nap_max_ns, &fd, &ring_spin_ns, &ring_nap_ns, &ring_nap_max_ns, &ring_window_ns,
                          &worked_ns, &urgent_us, &partner))
        return NULL;
    if (nap_max_ns < nap_ns)
        nap_max_ns = nap_ns;
    if (ring_nap_ns <= 0)
        ring_nap_ns = nap_ns;
    if (ring_nap_max_ns < ring_nap_ns)
        ring_nap_max_ns = ring_nap_ns;
    if (urgent_us > 0)
        give_back_switch_interval();
    iprobe_fn iprobe = (iprobe_fn)(uintptr_t)addr;
    int flag = 0, rc = 0, interrupted = 0;
    char status[256]; /* larger than any MPI_Status */
    Py_BEGIN_ALLOW_THREADS
    int64_t start = mono_ns(), spin_from = start, looked = start + PARTNER_FIRST_NS - PARTNER_LOOK_NS;
    struct timespec nap = {(time_t)(nap_ns / 1000000000), (long)(nap_ns % 1000000000)};
    int slack = -1; /* the thread's timer slack, while naps run with a tight one */
    int partner_fd = -2; /* the partner's stat file, once looked at (see partner_waits_here) */
    for (;;) {
        int64_t before = worked_ns > 0 ? mono_ns() : 0;
        rc = iprobe(any, tag, (intptr_t)(uintptr_t)comm, &flag, status);
        if (rc != 0 || flag)
            break;
        int64_t now = mono_ns();
        if (now - start >= max_ns)
            break;
        if (now - spin_from < spin_ns) {
            /* no sched_yield per probe (it made replies come 4x later, at random, on a 2-core machine), nor a
             * yield every 20 us (to the holder's computing rank: its p99 went from 1.6-2.6 ms to 3.3-3.7 ms). Only
             * where the partner waits for this very CPU: a 20 us nap, not a yield, so that this thread wakes
             * where a CPU is free (a yield kept both on one core: gets 20-40 us slower at the median) */
            if (partner > 0 && now - looked >= PARTNER_LOOK_NS) {
                looked = now;
                int cpu = sched_getcpu();
                if (partner_waits_here(&partner_fd, partner, cpu) && !hop_off(cpu)) {
                    tighten_slack(&slack); /* a 20 us nap, not 70 */
                    struct timespec step = {0, 20000};
                    nanosleep(&step, NULL);
                    partner_naps++;
                }
            }
            continue;
        }
        if (worked_ns > 0 && now - before > worked_ns)
            continue; /* the probe moved bytes (over TCP MPI reads a frame queued before the reply inside it):
                       * again at once; a nap after each made a 1 MiB transfer take 3.8 ms, not 0.4-1 */
        if (nap_ns < 1000000)
            tighten_slack(&slack);
        int woke = nap_or_ring(fd, &nap);
        if (woke < 0) {
            interrupted = 1; /* a signal for this thread: Python runs its handler when we return */
            break;
        }
        if (woke > 0) { /* rung: the request is here or on its way */
            spin_from = mono_ns();
            looked = spin_from + PARTNER_FIRST_NS - PARTNER_LOOK_NS;
            spin_ns = ring_spin_ns;
            nap_ns = ring_nap_ns;
            nap_max_ns = ring_nap_max_ns;
            if (spin_from - start + ring_window_ns > max_ns)
                max_ns = spin_from - start + ring_window_ns;
        } else if (nap_ns < nap_max_ns) {
            nap_ns = nap_ns * 2 < nap_max_ns ? nap_ns * 2 : nap_max_ns;
        }
        nap.tv_sec = (time_t)(nap_ns / 1000000000);
        nap.tv_nsec = (long)(nap_ns % 1000000000);
    }
    if (slack > 0)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    if (partner_fd >= 0)
        close(partner_fd);
    if (urgent_us > 0) /* a request to handle, or the idle loop's look between sleeps: either way a short wait */
        lower_switch_interval((unsigned long)urgent_us);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc != 0 ? -(long)(rc < 0 ? -rc : rc) : flag ? 1 : interrupted ? 2 : 0);
}

/* take_rings(fd) -> (rings taken, whether one came from this thread's CPU); leaves rung_here's flag as it is. For tests. */
static PyObject *py_take_rings(PyObject *self, PyObject *args) {
    int fd, here = 0;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    int count = take_rings(fd, &here);
    return Py_BuildValue("(iO)", count, here ? Py_True : Py_False);
}

/* partner_naps() -> how often probe_wait on this thread napped for its partner. For tests. */
static PyObject *py_partner_naps(PyObject *self, PyObject *noargs) { return PyLong_FromLong(partner_naps); }

/* set_hop(allowed) -> None: whether a spin may move its thread off the CPU its partner waits for (hop_off); 2
 * (tests): whether or not another CPU idles. */
static PyObject *py_set_hop(PyObject *self, PyObject *args) {
    int allowed;
    if (!PyArg_ParseTuple(args, "i", &allowed))
        return NULL;
    hop_allowed = allowed;
    Py_RETURN_NONE;
}

/* partner_hops() -> how often probe_wait on this thread moved off its partner's CPU. For tests. */
static PyObject *py_partner_hops(PyObject *self, PyObject *noargs) { return PyLong_FromLong(partner_hops); }

/* partner_waits(tid) -> whether thread ``tid`` waits to run on this thread's CPU. For tests. */
static PyObject *py_partner_waits(PyObject *self, PyObject *args) {
    int tid;
    if (!PyArg_ParseTuple(args, "i", &tid))
        return NULL;
    int fd = -2, waits = partner_waits_here(&fd, tid, sched_getcpu());
    if (fd >= 0)
        close(fd);
    return PyBool_FromLong(waits);
}

static PyObject *py_kernel_id(PyObject *self, PyObject *noargs) { return PyLong_FromUnsignedLong(kernel_id); }

static PyObject *py_rung_here(PyObject *self, PyObject *noargs) {
    int here = rung_from_here;
    rung_from_here = 0;
    return PyBool_FromLong(here);
}

/* lowers() -> whether probe_wait(urgent_us) lowers the switch interval itself (Python before 3.12). */
static PyObject *py_lowers(PyObject *self, PyObject *noargs) { return PyBool_FromLong(PY_VERSION_HEX < 0x030C0000); }

/* give_back() -> None: the application's switch interval, where probe_wait lowered it (the service is idle or
 * leaves; a forked child). */
static PyObject *py_give_back(PyObject *self, PyObject *noargs) {
    give_back_switch_interval();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"probe_wait", probe_wait, METH_VARARGS, "Wait for an MPI message with the GIL released (see above)."},
    {"take_rings", py_take_rings, METH_VARARGS, "Take the rings waiting on a bell (see above)."},
    {"partner_naps", py_partner_naps, METH_NOARGS, "How often probe_wait on this thread napped for its partner."},
    {"set_hop", py_set_hop, METH_VARARGS, "Whether a spin may move its thread off its partner's CPU."},
    {"partner_hops", py_partner_hops, METH_NOARGS, "How often probe_wait on this thread moved off its partner's CPU."},
    {"partner_waits", py_partner_waits, METH_VARARGS, "Whether a thread waits to run on this thread's CPU."},
    {"kernel_id", py_kernel_id, METH_NOARGS, "This kernel's identity as rings carry it."},
    {"rung_here", py_rung_here, METH_NOARGS, "Whether the last rings came from this CPU (then cleared)."},
    {"lowers", py_lowers, METH_NOARGS, "Whether probe_wait(urgent_us) lowers the switch interval itself."},
    {"give_back", py_give_back, METH_NOARGS, "The application's switch interval, where probe_wait lowered it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__probe(void) {
    kernel_id = read_kernel_id();
    return PyModule_Create(&module);
}
