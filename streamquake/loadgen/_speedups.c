/* Compiled twins of two hot loops of the load process (issue 36). Each has a pure-Python
 * original that stays (streamquake/loadgen/speedups.py picks one; STREAMQUAKE_SPEEDUPS=0 picks
 * Python), and the tests check that both give the same answers (tests/test_speedups.py).
 *
 * count_ms: a stream's gaps into a sparse HDR histogram's counts (histogram.count_ms).
 * recv_stamped: one read of a plain TCP socket with the kernel's receive stamp
 *               (stamps.Arrival.recv's recvmsg, cmsg parsing and two clock reads).
 *
 * Built by `pip install -e .` (scripts/setup) through setup.py; optional there: where it cannot
 * be built, the Python path runs, and the run's report says which ran.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HIGHEST 3600000000LL /* histogram.HIGHEST */

#ifndef SO_TIMESTAMPNS
#define SO_TIMESTAMPNS 35
#endif

/* int(x).bit_length() for x > 0 */
static inline int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* count_ms(counts, values, mask, unit, half_magnitude, half, base) -> number counted
 *
 * for ms in values:
 *     value = round(ms * 1000.0), clamped to 0..HIGHEST
 *     bucket = (value | mask).bit_length() - unit - half_magnitude - 1
 *     key = base + ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half
 *     counts[key] = counts.get(key, 0) + 1
 */
static PyObject *count_ms(PyObject *self, PyObject *args) {
    PyObject *counts, *values;
    long long mask, unit, half_magnitude, half, base;
    if (!PyArg_ParseTuple(args, "O!OLLLLL", &PyDict_Type, &counts, &values, &mask, &unit,
                          &half_magnitude, &half, &base))
        return NULL;
    PyObject *seq = PySequence_Fast(values, "count_ms: values must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        double ms = PyFloat_AsDouble(items[i]);
        if (ms == -1.0 && PyErr_Occurred())
            goto fail;
        double scaled = ms * 1000.0;
        if (isnan(scaled)) {
            PyErr_SetString(PyExc_ValueError, "cannot convert float NaN to integer");
            goto fail;
        }
        if (isinf(scaled)) {
            PyErr_SetString(PyExc_OverflowError, "cannot convert float infinity to integer");
            goto fail;
        }
        /* Python's round(): to the nearest, ties to even (the default rounding mode) */
        double r = nearbyint(scaled);
        long long value = r >= (double)HIGHEST ? HIGHEST : (r > 0.0 ? (long long)r : 0);
        long long bucket = bit_length((uint64_t)(value | mask)) - unit - half_magnitude - 1;
        long long key = base + ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half;
        PyObject *k = PyLong_FromLongLong(key);
        if (k == NULL)
            goto fail;
        PyObject *old = PyDict_GetItemWithError(counts, k); /* borrowed */
        long long now = 1;
        if (old != NULL) {
            now = PyLong_AsLongLong(old) + 1;
            if (now == 0 && PyErr_Occurred()) {
                Py_DECREF(k);
                goto fail;
            }
        } else if (PyErr_Occurred()) {
            Py_DECREF(k);
            goto fail;
        }
        PyObject *v = PyLong_FromLongLong(now);
        if (v == NULL || PyDict_SetItem(counts, k, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(k);
            goto fail;
        }
        Py_DECREF(v);
        Py_DECREF(k);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
fail:
    Py_DECREF(seq);
    return NULL;
}

static inline double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* recv_stamped(fd, size) -> (data, seen, lag)
 *
 * One recvmsg of at most ``size`` bytes (64 KiB at most) that never waits (EAGAIN: BlockingIOError, as the
 * socket module raises it); ``seen``: time.perf_counter() right after it; ``lag``: how long
 * before that the kernel stamped the bytes' arrival (SCM_TIMESTAMPNS, CLOCK_REALTIME, against
 * time.time() now), or -1.0 where the read carried no stamp. EINTR is retried.
 */
static PyObject *recv_stamped(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "in", &fd, &size))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "negative buffersize in recv_stamped");
        return NULL;
    }
    /* One buffer for every read (the GIL is held throughout: the call never waits), and the
     * bytes copied out at their size: no block-sized allocation per read. */
    static char block[1 << 16];
    if ((size_t)size > sizeof block)
        size = sizeof block;
    union {
        char bytes[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {block, (size_t)size};
    struct msghdr msg;
    ssize_t got;
    do {
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.bytes;
        msg.msg_controllen = sizeof control.bytes;
        got = recvmsg(fd, &msg, MSG_DONTWAIT);
    } while (got < 0 && errno == EINTR);
    if (got < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    double seen = seconds(CLOCK_MONOTONIC);
    double lag = -1.0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS &&
            c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            double stamp = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
            lag = seconds(CLOCK_REALTIME) - stamp;
            if (lag < 0.0)
                lag = 0.0;
            break;
        }
    }
    PyObject *buf = PyBytes_FromStringAndSize(block, got);
    if (buf == NULL)
        return NULL;
    return Py_BuildValue("(Ndd)", buf, seen, lag);
}

static PyMethodDef methods[] = {
    {"count_ms", count_ms, METH_VARARGS,
     "count_ms(counts, values, mask, unit, half_magnitude, half, base) -> n: histogram.count_ms"},
    {"recv_stamped", recv_stamped, METH_VARARGS,
     "recv_stamped(fd, size) -> (data, seen, lag): one stamped read that never waits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "Compiled twins of the load process's hot loops (see speedups.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
