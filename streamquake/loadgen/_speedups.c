/* Compiled twins of hot loops of the load process (issue 36). Each has a pure-Python
 * original that stays (streamquake/loadgen/speedups.py picks one; STREAMQUAKE_SPEEDUPS=0 picks
 * Python), and the tests check that both give the same answers (tests/test_speedups.py).
 *
 * count_ms: a stream's gaps into a sparse HDR histogram's counts (histogram.count_ms).
 * recv_stamped: one read of a plain TCP socket with the kernel's receive stamp
 *               (stamps.Arrival.recv's recvmsg, cmsg parsing and two clock reads).
 * Chunked: that read, and the HTTP/1.1 chunked framing of the body decoded in C
 *          (what geventhttpclient's parser and its Python callback do for a body's reads).
 * framed_events: how many events of a stream's template a read begins with (wire.PlainTemplate).
 * FramedStep: a stream's read in the shared reader, folded in whole where it is its template's
 *             events only (client._Stream._step_read -> chunk -> _Tally.add_framed).
 * varints, pairs_le32: a histogram's or table's counts written for a checkpoint
 *                      (histogram._varints_py, histogram._pairs_le32_py).
 *
 * Built by `pip install -e .` (scripts/setup) through setup.py; optional there: where it cannot
 * be built, the Python path runs, and the run's report says which ran.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

#define HIGHEST 3600000000LL /* histogram.HIGHEST */

#ifndef SO_TIMESTAMPNS
#define SO_TIMESTAMPNS 35
#endif

/* int(x).bit_length() for x > 0 */
static inline int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* Ascending, in place: insertion sort (a stream's gaps: a few dozen keys). */
static void sort_keys(long long *k, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        long long v = k[i];
        Py_ssize_t j = i;
        for (; j > 0 && k[j - 1] > v; j--)
            k[j] = k[j - 1];
        k[j] = v;
    }
}

static int cmp_keys(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* count_ms(counts, values, mask, unit, half_magnitude, half, base) -> number counted
 *
 * for ms in values:
 *     value = round(ms * 1000.0), clamped to 0..HIGHEST
 *     bucket = (value | mask).bit_length() - unit - half_magnitude - 1
 *     key = base + ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half
 *     counts[key] = counts.get(key, 0) + 1
 *
 * Each value's key first (a value Python cannot round fails before ``counts`` is touched),
 * then the keys sorted and each distinct one looked up and set once, with its run's length:
 * the dict's work and its ints' allocations are the most of the count, and a stream's gaps
 * repeat buckets (its zero gaps, a steady pace at 2 digits). */
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
    long long stack[128];
    long long *keys = stack;
    if (n > 128) {
        keys = PyMem_Malloc((size_t)n * sizeof(long long));
        if (keys == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
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
        keys[i] = base + ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half;
    }
    if (n <= 64)
        sort_keys(keys, n);
    else
        qsort(keys, (size_t)n, sizeof(long long), cmp_keys);
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i + 1;
        while (j < n && keys[j] == keys[i])
            j++;
        PyObject *k = PyLong_FromLongLong(keys[i]);
        if (k == NULL)
            goto fail;
        PyObject *old = PyDict_GetItemWithError(counts, k); /* borrowed */
        long long now = j - i;
        if (old != NULL) {
            long long was = PyLong_AsLongLong(old);
            if (was == -1 && PyErr_Occurred()) {
                Py_DECREF(k);
                goto fail;
            }
            now += was;
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
        i = j;
    }
    if (keys != stack)
        PyMem_Free(keys);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
fail:
    if (keys != stack)
        PyMem_Free(keys);
    Py_DECREF(seq);
    return NULL;
}

static inline double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One recvmsg into ``buf`` that never waits, EINTR retried; ``*seen``: CLOCK_MONOTONIC (what
 * time.perf_counter() reads) right after it; ``*lag``: how long before that the kernel stamped
 * the bytes (SCM_TIMESTAMPNS, CLOCK_REALTIME, against the real-time clock now), -1.0 where the
 * read carried no stamp. Returns what recvmsg returned (errno set when negative). */
static ssize_t stamped_recvmsg(int fd, char *buf, size_t size, double *seen, double *lag) {
    union {
        char bytes[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {buf, size};
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
        return got;
    *seen = seconds(CLOCK_MONOTONIC);
    *lag = -1.0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS &&
            c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            double stamp = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
            double lagged = seconds(CLOCK_REALTIME) - stamp;
            *lag = lagged < 0.0 ? 0.0 : lagged;
            break;
        }
    }
    return got;
}

static char block[1 << 16];     /* one read's bytes (the GIL is held throughout: no call waits) */

/* recv_stamped(fd, size) -> (data, seen, lag)
 *
 * One read of at most ``size`` bytes (64 KiB at most) that never waits (EAGAIN:
 * BlockingIOError, as the socket module raises it); ``seen`` and ``lag`` as stamped_recvmsg
 * gives them.
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
    if ((size_t)size > sizeof block)
        size = sizeof block;
    double seen, lag;
    ssize_t got = stamped_recvmsg(fd, block, (size_t)size, &seen, &lag);
    if (got < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *buf = PyBytes_FromStringAndSize(block, got);
    if (buf == NULL)
        return NULL;
    return Py_BuildValue("(Ndd)", buf, seen, lag);
}

/* Chunked(): one response body's HTTP/1.1 chunked framing (RFC 9112 7.1), decoded from the
 * first byte of the body on, as far as it is the plain kind (hex size, CRLF, data, CRLF; then
 * "0" CRLF CRLF): Chunked.read(fd) -> (body, seen, lag, nraw, rest) makes one stamped read
 * as recv_stamped does (nraw: the bytes read, 0 when the peer closed) and returns its chunk
 * data. ``rest`` is None while the body goes on so; else it is the read's bytes from the start
 * of the size line where the plain kind ended (the last chunk's "0" line, or one with a chunk
 * extension, whitespace, a trailer, a size past 15 digits, anything else) to the end of the
 * read: the caller hands them to its HTTP parser, which stands where this one started (at a
 * size line, before any chunk), and reads the rest of the body with it. So the parser judges
 * everything but the plain kind, and the end of the message (the connection's reuse) too.
 * Chunk data not followed by CRLF raises ValueError(message, code), in llhttp's words.
 * client.py hands a stream's body to it only where its parser stands at the body's first
 * byte. */
enum { C_SIZE, C_SIZE_LF, C_DATA, C_DATA_CR, C_DATA_LF, C_OVER };

#define LINE_MAX_DIGITS 15
#define CARRY_MAX 32

typedef struct {
    PyObject_HEAD
    int state;
    int digits;          /* hex digits of the size line so far */
    uint64_t size;       /* the size line's value, then the chunk data still to come */
    char *out;           /* where decode() writes the body bytes, during a call */
    /* the current size line's bytes from earlier reads (a line cut between reads) */
    char carry[CARRY_MAX];
    Py_ssize_t carried;
} Chunked;

static char body_block[1 << 16];    /* one read's body bytes (never more than its bytes) */

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decode ``data[0:n]``, the body bytes appended at self->out + *outn; ``*line_start``: where
 * in ``data`` the current size line began (0 when it began in an earlier read). Returns 0 when
 * the plain kind held to the end of the bytes, 1 where it ended (at the current size line),
 * -2 with an exception set. */
static int decode(Chunked *self, const unsigned char *data, Py_ssize_t n, Py_ssize_t *outn,
                  Py_ssize_t *line_start) {
    Py_ssize_t i = 0;
    /* where the current size line began in ``data`` (0 with bytes carried: it began before) */
    *line_start = 0;
    while (i < n) {
        unsigned char c = data[i];
        switch (self->state) {
        case C_SIZE: {
            int v = hexval(c);
            if (v >= 0 && self->digits < LINE_MAX_DIGITS) {
                self->size = self->size * 16 + (uint64_t)v;
                self->digits++;
            } else if (self->digits && c == '\r') {
                self->state = C_SIZE_LF;
            } else {
                return 1;       /* not the plain kind: the parser's from this line on */
            }
            i++;
            break;
        }
        case C_SIZE_LF:
            if (c != '\n' || self->size == 0)
                return 1;       /* the parser's: a broken line, or the last chunk's */
            i++;
            self->digits = 0;
            self->carried = 0;
            self->state = C_DATA;
            break;
        case C_DATA: {
            Py_ssize_t take = n - i;
            if ((uint64_t)take > self->size)
                take = (Py_ssize_t)self->size;
            memcpy(self->out + *outn, data + i, (size_t)take);
            *outn += take;
            i += take;
            self->size -= (uint64_t)take;
            if (!self->size)
                self->state = C_DATA_CR;
            break;
        }
        case C_DATA_CR:
            if (c != '\r') {      /* llhttp's words and codes for the two */
                PyErr_SetObject(PyExc_ValueError,
                                c == '\n' ? Py_BuildValue("(si)", "Missing expected CR after chunk data", 25)
                                          : Py_BuildValue("(si)", "Expected LF after chunk data", 2));
                return -2;
            }
            i++;
            self->state = C_DATA_LF;
            break;
        case C_DATA_LF:
            if (c != '\n') {
                PyErr_SetObject(PyExc_ValueError,
                                Py_BuildValue("(si)", "Expected LF after chunk data", 2));
                return -2;
            }
            i++;
            self->state = C_SIZE;
            *line_start = i;
            break;
        default:
            return 1;
        }
    }
    return 0;
}

static int Chunked_init(Chunked *self, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ":Chunked"))
        return -1;
    self->state = C_SIZE;
    self->digits = 0;
    self->size = 0;
    self->carried = 0;
    return 0;
}

/* The bytes of ``data[0:n]`` decoded, as (body, rest) (see above); the body into ``out``. */
static PyObject *decode_all(Chunked *self, const char *data, Py_ssize_t n, char *out,
                            Py_ssize_t *outn) {
    if (self->state == C_OVER) {
        PyErr_SetString(PyExc_ValueError, "the body was handed over");
        return NULL;
    }
    Py_ssize_t line_start;
    self->out = out;
    *outn = 0;
    int got = decode(self, (const unsigned char *)data, n, outn, &line_start);
    self->out = NULL;
    if (got == -2)
        return NULL;
    if (got == 0) {
        /* a size line cut by the read's end: its bytes so far kept for the hand-over */
        if (self->state == C_SIZE || self->state == C_SIZE_LF) {
            Py_ssize_t part = n - line_start;
            if (self->carried + part > CARRY_MAX) {
                got = 1;        /* cannot be a plain line */
            } else {
                memcpy(self->carry + self->carried, data + line_start, (size_t)part);
                self->carried += part;
                Py_RETURN_NONE;
            }
        } else {
            Py_RETURN_NONE;
        }
    }
    /* handed over: the line's carried bytes, then this read's from the line's start */
    self->state = C_OVER;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, self->carried + (n - line_start));
    if (rest == NULL)
        return NULL;
    memcpy(PyBytes_AS_STRING(rest), self->carry, (size_t)self->carried);
    memcpy(PyBytes_AS_STRING(rest) + self->carried, data + line_start, (size_t)(n - line_start));
    return rest;
}

/* feed(data) -> (body, rest): the bytes as read() would decode them (the tests) */
static PyObject *Chunked_feed(Chunked *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    char *out = PyMem_Malloc(view.len ? (size_t)view.len : 1);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_ssize_t outn;
    PyObject *rest = decode_all(self, view.buf, view.len, out, &outn);
    PyBuffer_Release(&view);
    PyObject *result = NULL;
    if (rest != NULL)
        result = Py_BuildValue("(y#N)", out, outn, rest);
    PyMem_Free(out);
    return result;
}

static PyObject *Chunked_read(Chunked *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX) {
        errno = EBADF;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (self->state == C_OVER) {
        PyErr_SetString(PyExc_ValueError, "the body was handed over");
        return NULL;
    }
    double seen, lag;
    ssize_t got = stamped_recvmsg((int)fd, block, sizeof block, &seen, &lag);
    if (got < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_ssize_t outn;
    PyObject *rest = decode_all(self, block, got, body_block, &outn);
    if (rest == NULL)
        return NULL;
    return Py_BuildValue("(y#ddnN)", body_block, outn, seen, lag, (Py_ssize_t)got, rest);
}

static PyMethodDef Chunked_methods[] = {
    {"read", (PyCFunction)Chunked_read, METH_O,
     "read(fd) -> (body, seen, lag, nraw, rest): one stamped read, its chunk data"},
    {"feed", (PyCFunction)Chunked_feed, METH_O, "feed(data) -> (body, rest)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChunkedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamquake.loadgen._speedups.Chunked",
    .tp_basicsize = sizeof(Chunked),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One response body's plain chunked framing, decoded from its first byte.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Chunked_init,
    .tp_methods = Chunked_methods,
};

/* framed_events(read, head, tail) -> (k, end): how many events ``read`` begins with, each
 * ``head``, then a non-empty JSON string body needing no escape (printable ASCII but '"' and
 * '\'), then ``tail`` (which begins with the string's closing '"'), and where they end (the
 * read's length where it is nothing else); (0, 0) where it begins with anything else
 * (wire.PlainTemplate.framed, whose Python it stands in for). */
static inline int string_body_byte(unsigned char c) {
    return c >= 0x20 && c <= 0x7e && c != '"' && c != '\\';
}

/* The events a read ``r[0:n]`` begins with (framed_events' count), ``*end`` where they end. */
static Py_ssize_t framed_run(const unsigned char *r, Py_ssize_t n, const char *head,
                             Py_ssize_t nh, const char *tail, Py_ssize_t nt, Py_ssize_t *end) {
    Py_ssize_t i = 0, k = 0;
    if (nt == 0 || tail[0] != '"') {
        *end = 0;
        return 0;
    }
    while (i < n) {
        if (n - i < nh + 1 + nt || memcmp(r + i, head, (size_t)nh) != 0)
            break;
        Py_ssize_t j = i + nh;
        while (j < n && string_body_byte(r[j]))
            j++;
        if (j == i + nh || n - j < nt || memcmp(r + j, tail, (size_t)nt) != 0)
            break;
        i = j + nt;
        k++;
    }
    *end = i;
    return k;
}

static PyObject *framed_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1]) ||
        !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "framed_events(read, head, tail): three bytes");
        return NULL;
    }
    Py_ssize_t end;
    Py_ssize_t k = framed_run((const unsigned char *)PyBytes_AS_STRING(args[0]),
                              PyBytes_GET_SIZE(args[0]), PyBytes_AS_STRING(args[1]),
                              PyBytes_GET_SIZE(args[1]), PyBytes_AS_STRING(args[2]),
                              PyBytes_GET_SIZE(args[2]), &end);
    return Py_BuildValue("(nn)", k, end);
}

/* FramedStep(stream, backlog, parse_error, burst_wait_ms, buckets_per_e): the shared reader's
 * step (reader.Reader) for one stream whose body's framing is decoded here (client._Stream with
 * its ``fast`` Chunked): called with no arguments, it makes the stream's read as
 * Chunked.read does, and where the read's body is nothing but events of the stream's template
 * and the stream stands where _Tally.add_framed folds them in without any rarer judgement,
 * folds them in here, as client._Stream._step_read -> chunk -> _Tally.add_framed -> _fold ->
 * _Stream._clock -> self_measure.Guard.seen do in Python; it returns what _step_read would
 * (``backlog`` after a read that filled the whole block, else None). Any other read goes to
 * the stream's ``_step_read`` as it came, and a stream no longer decoded here (its ``fast``
 * gone, its socket closed) to its ``step``. Chunk data not ended by CRLF raises
 * ``parse_error(message, code)``, as _step_fast does.
 *
 * From the first read it folds, the stream's state (its sample's counts and gaps, its tally's
 * and arrival's times) is held here, not in its Python objects, whose memory a read in a
 * process of hundreds of streams finds cold: flush() gives it back, as it does itself before
 * any read it hands to Python, and the stream's reader calls it when the stream leaves the
 * shared reader (its end, a timeout, a failure). The guard's account is kept in the guard.
 *
 * ``fold(body, seen, lag, nraw)``: what a call does after its read, for a read given (the tests
 * hold it equal to _step_read). ``reads``, ``folded``: what it did; ``hot``: whether the
 * stream's state is its own now. */
typedef struct {
    PyObject_HEAD
    PyObject *stream, *fast, *resp, *tally, *sample, *arrival, *parser, *guard;
    PyObject *backlog, *parse_error, *read_rest, *step;
    int fd;
    double burst_wait_ms, buckets_per_e;
    long long reads, folded;
    /* While ``hot``, the stream's state is these (its Python objects' copies are stale until
     * flush; nothing but this step touches the stream meanwhile): taken by load(), given
     * back by flush() before any read that is Python's, and when the stream's reading ends
     * (client._Stream's reader leaves it). ``dirty``: a read was folded since it was taken. */
    int hot, dirty, read_held;
    PyObject *head, *tail, *itl;    /* the template's framed bytes; the sample's gaps */
    long long size, max_line, max_event, events_left, read_events, content_reads;
    long long content_events, shared_stamps, body_bytes, kernel_reads, last_events;
    long long burst_reads, burst_events, first_read_events;
    double at, seen, last_text_at, last_text_seen, stall_s, deadline;
    double *itl_buf;                /* gaps folded since, for the sample's list */
    Py_ssize_t itl_n, itl_cap;
} FramedStep;

static PyObject *n_fast, *n_sock, *n_plain, *n_size, *n_framed_head, *n_framed_tail, *n_abandon,
    *n_pending, *n_data, *n_event, *n_skip_lf, *n_bom_checked, *n_retry, *n_max_line,
    *n_max_event, *n_last_id, *n_last_text_at, *n_last_text_seen, *n_answer, *n_events_left,
    *n_read_events, *n_read_held, *n_ttfa_ms, *n_content_reads, *n_content_events, *n_itl_ms,
    *n_shared_stamps, *n_body_bytes, *n_at, *n_seen, *n_kernel, *n_with_headers,
    *n_kernel_reads, *n_last_events, *n_deadline, *n_seen_buckets, *n_guard_reads,
    *n_seen_max_s, *n_stall_s, *n_message_complete, *n_tally, *n_sample, *n_arrival, *n_parser,
    *n_guard, *n_resp, *n_fd, *n_step_read, *n_step, *n_paced, *n_burst_reads, *n_burst_events,
    *n_first_read_events;

static int intern_names(void) {
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(n_fast, "fast") NAME(n_sock, "_sock") NAME(n_plain, "_plain") NAME(n_size, "size")
    NAME(n_framed_head, "framed_head") NAME(n_framed_tail, "framed_tail")
    NAME(n_abandon, "abandon") NAME(n_pending, "_pending") NAME(n_data, "_data")
    NAME(n_event, "_event") NAME(n_skip_lf, "_skip_lf") NAME(n_bom_checked, "_bom_checked")
    NAME(n_retry, "_retry") NAME(n_max_line, "_max_line") NAME(n_max_event, "_max_event")
    NAME(n_last_id, "_last_id") NAME(n_last_text_at, "last_text_at")
    NAME(n_last_text_seen, "last_text_seen") NAME(n_answer, "answer")
    NAME(n_events_left, "events_left") NAME(n_read_events, "read_events")
    NAME(n_read_held, "read_held") NAME(n_ttfa_ms, "ttfa_ms")
    NAME(n_content_reads, "content_reads") NAME(n_content_events, "content_events")
    NAME(n_itl_ms, "itl_ms") NAME(n_shared_stamps, "shared_stamps")
    NAME(n_body_bytes, "body_bytes") NAME(n_at, "at") NAME(n_seen, "seen")
    NAME(n_kernel, "kernel") NAME(n_with_headers, "with_headers")
    NAME(n_kernel_reads, "kernel_reads") NAME(n_last_events, "last_events")
    NAME(n_deadline, "deadline") NAME(n_seen_buckets, "_seen")
    NAME(n_guard_reads, "_kernel_reads") NAME(n_seen_max_s, "_seen_max_s")
    NAME(n_stall_s, "stall_s") NAME(n_message_complete, "message_complete")
    NAME(n_tally, "tally") NAME(n_sample, "sample") NAME(n_arrival, "arrival")
    NAME(n_parser, "parser") NAME(n_guard, "guard") NAME(n_resp, "resp") NAME(n_fd, "fd")
    NAME(n_step_read, "_step_read") NAME(n_step, "step") NAME(n_paced, "paced")
    NAME(n_burst_reads, "burst_reads") NAME(n_burst_events, "burst_events")
    NAME(n_first_read_events, "first_read_events")
#undef NAME
    return 0;
}

/* An attribute's value as a C number: 1 when it is one (a float, or an int, exactly), 0 when
 * it is anything else (None, say: the caller leaves the read to Python), -1 on an error. */
static int get_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int ok = 1;
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
    } else {
        ok = 0;
    }
    Py_DECREF(v);
    return ok;
}

static int get_long(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int ok = 0;
    if (PyLong_CheckExact(v)) {
        int overflow;
        *out = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (*out == -1 && PyErr_Occurred()) {
            Py_DECREF(v);
            return -1;
        }
        ok = !overflow;
    }
    Py_DECREF(v);
    return ok;
}

/* 1 where the attribute is None, 0 where not, -1 on an error. */
static int is_none(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

static int truth(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int set_double(PyObject *obj, PyObject *name, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

static int set_long(PyObject *obj, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

/* The read is taken on only where ``expr`` is true (REQUIRE) or false (REFUSE); an error
 * (negative) is raised. */
#define REQUIRE(expr) do { int _r = (expr); if (_r < 0) return -1; if (!_r) return 0; } while (0)
#define REFUSE(expr) do { int _r = (expr); if (_r < 0) return -1; if (_r) return 0; } while (0)

/* Take the stream's state from its Python objects, where it stands where add_framed folds
 * template reads in without a rarer judgement (otherwise the read is Python's): 1 when taken
 * (``hot``: from here on the stream's state is the struct's, until flush); 0 with nothing
 * changed where not; -1 on an error. */
static int load(FramedStep *self) {
    PyObject *tally = self->tally, *sample = self->sample, *parser = self->parser;
    long long kernel_reads;
    PyObject *fast = PyObject_GetAttr(self->stream, n_fast);
    if (fast == NULL)
        return -1;
    Py_DECREF(fast);        /* only compared: self holds its own */
    if (fast != self->fast)
        return 0;
    /* the template */
    PyObject *template = PyObject_GetAttr(tally, n_plain);
    if (template == NULL)
        return -1;
    if (template == Py_None) {
        Py_DECREF(template);
        return 0;
    }
    int got = get_long(template, n_size, &self->size);
    PyObject *head = got <= 0 ? NULL : PyObject_GetAttr(template, n_framed_head);
    PyObject *tail = head == NULL ? NULL : PyObject_GetAttr(template, n_framed_tail);
    Py_DECREF(template);
    if (tail == NULL) {
        Py_XDECREF(head);
        return got < 0 || PyErr_Occurred() ? -1 : 0;
    }
    Py_XSETREF(self->head, head);
    Py_XSETREF(self->tail, tail);
    if (self->size < 0 || !PyBytes_Check(head) || !PyBytes_Check(tail))
        return 0;
    /* chunk's shortcut, and the parser where SSEParser.clean says so, with no event id */
    REFUSE(is_none(self->resp, n_sock));
    REQUIRE(is_none(self->stream, n_abandon));
    REFUSE(truth(self->resp, n_message_complete));
    REFUSE(truth(parser, n_pending));
    REFUSE(truth(parser, n_data));
    REFUSE(truth(parser, n_event));
    REFUSE(truth(parser, n_skip_lf));
    REQUIRE(truth(parser, n_bom_checked));
    REQUIRE(is_none(parser, n_retry));
    REQUIRE(is_none(parser, n_last_id));
    REQUIRE(get_long(parser, n_max_line, &self->max_line));
    REQUIRE(get_long(parser, n_max_event, &self->max_event));
    /* _Tally._plain_gap's standing checks, and _fold's */
    REQUIRE(get_double(tally, n_last_text_at, &self->last_text_at));
    REFUSE(is_none(sample, n_ttfa_ms));
    REQUIRE(is_none(tally, n_answer));
    REQUIRE(get_long(tally, n_events_left, &self->events_left));
    REQUIRE(get_double(tally, n_stall_s, &self->stall_s));
    REQUIRE(get_double(tally, n_last_text_seen, &self->last_text_seen));
    int held = truth(tally, n_read_held);
    if (held < 0)
        return -1;
    self->read_held = held;
    REQUIRE(get_long(tally, n_read_events, &self->read_events));
    REFUSE(truth(tally, n_paced));      /* a slow consumer's pauses are its own, never held */
    REQUIRE(get_long(tally, n_first_read_events, &self->first_read_events));
    REQUIRE(get_long(sample, n_burst_reads, &self->burst_reads));
    REQUIRE(get_long(sample, n_burst_events, &self->burst_events));
    REQUIRE(get_long(sample, n_content_reads, &self->content_reads));
    REQUIRE(get_long(sample, n_content_events, &self->content_events));
    REQUIRE(get_long(sample, n_shared_stamps, &self->shared_stamps));
    REQUIRE(get_long(sample, n_body_bytes, &self->body_bytes));
    PyObject *itl = PyObject_GetAttr(sample, n_itl_ms);
    if (itl == NULL)
        return -1;
    Py_XSETREF(self->itl, itl);
    if (!PyList_CheckExact(itl))
        return 0;
    /* the arrival, and _Stream._clock: the stream's clock is "kernel" already */
    REQUIRE(get_double(self->arrival, n_at, &self->at));
    REQUIRE(get_double(self->arrival, n_seen, &self->seen));
    REQUIRE(get_long(self->stream, n_kernel_reads, &kernel_reads));
    if (kernel_reads < 1)
        return 0;
    self->kernel_reads = kernel_reads;
    REQUIRE(get_long(self->stream, n_last_events, &self->last_events));
    REQUIRE(get_double(self->stream, n_deadline, &self->deadline));
    if (self->guard != Py_None) {
        long long reads;
        double most;
        REQUIRE(get_long(self->guard, n_guard_reads, &reads));
        REQUIRE(get_double(self->guard, n_seen_max_s, &most));
        PyObject *buckets = PyObject_GetAttr(self->guard, n_seen_buckets);
        if (buckets == NULL)
            return -1;
        int dict = PyDict_CheckExact(buckets);
        Py_DECREF(buckets);
        if (!dict)
            return 0;
    }
    self->itl_n = 0;
    self->dirty = 0;
    self->hot = 1;
    return 1;
}

/* The struct's state back into the stream's Python objects (where a read was folded since it
 * was taken), and the stream's state theirs again: 0, or -1 on an error. */
static int flush(FramedStep *self) {
    if (!self->hot)
        return 0;
    self->hot = 0;
    if (!self->dirty)
        return 0;
    self->dirty = 0;
    PyObject *tally = self->tally, *sample = self->sample;
    for (Py_ssize_t i = 0; i < self->itl_n; i++) {
        PyObject *ms = PyFloat_FromDouble(self->itl_buf[i]);
        if (ms == NULL || PyList_Append(self->itl, ms) < 0) {
            Py_XDECREF(ms);
            return -1;
        }
        Py_DECREF(ms);
    }
    self->itl_n = 0;
    if (set_double(self->arrival, n_seen, self->seen) < 0 ||
        PyObject_SetAttr(self->arrival, n_with_headers, Py_False) < 0 ||
        set_double(self->arrival, n_at, self->at) < 0 ||
        PyObject_SetAttr(self->arrival, n_kernel, Py_True) < 0 ||
        set_long(sample, n_body_bytes, self->body_bytes) < 0 ||
        set_long(tally, n_events_left, self->events_left) < 0 ||
        set_long(sample, n_content_events, self->content_events) < 0 ||
        set_long(sample, n_content_reads, self->content_reads) < 0 ||
        set_long(tally, n_read_events, self->read_events) < 0 ||
        set_long(tally, n_first_read_events, self->first_read_events) < 0 ||
        set_long(sample, n_burst_reads, self->burst_reads) < 0 ||
        set_long(sample, n_burst_events, self->burst_events) < 0 ||
        PyObject_SetAttr(tally, n_read_held, self->read_held ? Py_True : Py_False) < 0 ||
        set_long(sample, n_shared_stamps, self->shared_stamps) < 0 ||
        set_double(tally, n_last_text_at, self->last_text_at) < 0 ||
        set_double(tally, n_last_text_seen, self->last_text_seen) < 0 ||
        set_long(self->stream, n_last_events, self->last_events) < 0 ||
        set_long(self->stream, n_kernel_reads, self->kernel_reads) < 0)
        return -1;
    return 0;
}

static int push_gap(FramedStep *self, double ms) {
    if (self->itl_n == self->itl_cap) {
        Py_ssize_t cap = self->itl_cap ? 2 * self->itl_cap : 64;
        double *buf = PyMem_Realloc(self->itl_buf, (size_t)cap * sizeof(double));
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->itl_buf = buf;
        self->itl_cap = cap;
    }
    self->itl_buf[self->itl_n++] = ms;
    return 0;
}

/* The guard's account of one kernel-stamped read (self_measure.Guard.seen(gap_s, k)): its log
 * bucket, exp(b / buckets_per_e) microseconds. */
static int guard_seen(FramedStep *self, double gap_s, long long k) {
    PyObject *guard = self->guard;
    long long reads, count = 0;
    double most;
    if (get_long(guard, n_guard_reads, &reads) <= 0 || get_double(guard, n_seen_max_s, &most) <= 0)
        goto changed;
    PyObject *buckets = PyObject_GetAttr(guard, n_seen_buckets);
    if (buckets == NULL)
        return -1;
    double us = gap_s * 1e6;
    PyObject *key = PyLong_FromLongLong(us > 1.0 ? (long long)(log(us) * self->buckets_per_e) : 0);
    PyObject *was = key == NULL ? NULL : PyDict_GetItemWithError(buckets, key);   /* borrowed */
    if (was != NULL)
        count = PyLong_AsLongLong(was);
    PyObject *value = PyErr_Occurred() ? NULL : PyLong_FromLongLong(count + k);
    int r = value == NULL ? -1 : PyDict_SetItem(buckets, key, value);
    Py_XDECREF(value);
    Py_XDECREF(key);
    Py_DECREF(buckets);
    if (r < 0 || set_long(guard, n_guard_reads, reads + 1) < 0)
        return -1;
    if (gap_s > most && set_double(guard, n_seen_max_s, gap_s) < 0)
        return -1;
    return 0;
changed:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "FramedStep: the guard's counts are not numbers");
    return -1;
}

/* The read's body ``body[0:n]`` folded in where it is template events only and the stream
 * stands where add_framed folds them without a rarer judgement: 1; 0 with the stream's state
 * its Python objects' again (flushed) and nothing else changed where it is not so (the caller
 * hands the read to _step_read); -1 on an error. Every check is made before anything changes. */
static int fold(FramedStep *self, const char *body, Py_ssize_t n, double seen, double lag) {
    if (!self->hot) {
        int got = load(self);
        if (got <= 0)
            return got;
    }
    Py_ssize_t end = 0, k = 0;
    double now = seen - lag, gap;
    int new_read;
    if (lag < 0.0 || n <= self->size + 8 || n > self->max_line || n > self->max_event)
        goto python;    /* no kernel stamp: _clock's "user" reads are Python's */
    k = framed_run((const unsigned char *)body, n, PyBytes_AS_STRING(self->head),
                   PyBytes_GET_SIZE(self->head), PyBytes_AS_STRING(self->tail),
                   PyBytes_GET_SIZE(self->tail), &end);
    if (k == 0 || end != n || self->events_left < k)
        goto python;
    if (self->at >= now)
        now = self->at;      /* Arrival.stamped: ``at`` never goes back */
    gap = now - self->last_text_at;
    if (gap > self->stall_s || seen - self->last_text_seen > self->stall_s)
        goto python;
    new_read = now != self->last_text_at;
    if (self->content_reads + new_read <= 1 || seen > self->deadline)
        goto python;
    /* _fold -> _Tally._held: a read after a wait long enough for a burst was held unless
     * the hub's own lateness (the guard's) makes up the difference */
    int held = self->read_held;
    if (new_read) {
        held = 0;
        if (gap * 1000.0 >= self->burst_wait_ms) {
            double blocked = 0.0;
            if (self->guard != Py_None) {
                PyObject *got = PyObject_CallMethod(self->guard, "blocked_within", "dd",
                                                    self->last_text_seen, seen);
                if (got == NULL)
                    return -1;
                blocked = PyFloat_AsDouble(got);
                Py_DECREF(got);
                if (blocked == -1.0 && PyErr_Occurred())
                    return -1;
            }
            held = (gap - blocked) * 1000.0 >= self->burst_wait_ms;
        }
    }
    long long shared, before;
    if (self->guard != Py_None && guard_seen(self, seen - now, k) < 0)
        return -1;
    self->dirty = 1;
    self->seen = seen;
    self->at = now;
    self->body_bytes += n;
    self->events_left -= k;
    self->content_events += k;
    if (new_read) {
        self->content_reads++;
        if (push_gap(self, gap * 1000.0) < 0)
            return -1;
        shared = k - 1;
        before = 0;
        self->read_held = held;
    } else {
        shared = k;
        before = self->read_events;
    }
    self->read_events = before + k;
    if (held && before + k > 1) {
        /* _count_read's count, event by event: the read's second event makes it a burst
         * (with the first read's events, should they still wait to be counted), and every
         * event of it from there on is a burst's */
        if (before < 2) {
            self->burst_reads++;
            self->burst_events += before + k + self->first_read_events;
            self->first_read_events = 0;
        } else {
            self->burst_events += k;
        }
    }
    for (long long i = 0; i < shared; i++)
        if (push_gap(self, 0.0) < 0)
            return -1;
    self->shared_stamps += shared;
    self->last_text_at = now;
    self->last_text_seen = seen;
    self->last_events = k;
    self->kernel_reads++;
    return 1;
python:
    return flush(self) < 0 ? -1 : 0;
}

#undef REQUIRE
#undef REFUSE

/* After a read of ``nraw`` bytes whose body is ``body[0:n]`` and whose framing went on
 * (``rest`` None): folded here, or handed to _step_read. Steals ``rest``. */
static PyObject *after_read(FramedStep *self, const char *body, Py_ssize_t n, double seen,
                            double lag, Py_ssize_t nraw, PyObject *rest) {
    if (rest == Py_None && nraw > 0 && n > 0) {
        int got = fold(self, body, n, seen, lag);
        if (got < 0) {
            Py_DECREF(rest);
            return NULL;
        }
        if (got) {
            Py_DECREF(rest);
            self->folded++;
            return Py_NewRef(nraw >= (Py_ssize_t)sizeof block ? self->backlog : Py_None);
        }
    } else if (flush(self) < 0) {
        Py_DECREF(rest);
        return NULL;
    }
    PyObject *out = PyObject_CallFunction(self->read_rest, "y#ddnO", body, n, seen, lag, nraw,
                                          rest);
    Py_DECREF(rest);
    return out;
}

static PyObject *FramedStep_call(FramedStep *self, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "FramedStep() takes no arguments");
        return NULL;
    }
    Chunked *fast = (Chunked *)self->fast;
    if (!self->hot) {
        /* hot: nothing but this step has touched the stream since its state was taken (its
         * framing still decoded here, its socket open); else Python may have */
        PyObject *now = PyObject_GetAttr(self->stream, n_fast);
        if (now == NULL)
            return NULL;
        Py_DECREF(now);
        if (now != self->fast || fast->state == C_OVER)
            return PyObject_CallNoArgs(self->step);     /* no longer decoded here */
        int closed = is_none(self->resp, n_sock);
        if (closed < 0)
            return NULL;
        if (closed)
            return PyObject_CallNoArgs(self->step);     /* closed: step says so */
    }
    double seen, lag;
    ssize_t got = stamped_recvmsg(self->fd, block, sizeof block, &seen, &lag);
    if (got < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    self->reads++;
    Py_ssize_t outn;
    PyObject *rest = decode_all(fast, block, got, body_block, &outn);
    if (rest == NULL) {
        if (flush(self) < 0)
            return NULL;    /* (an error of its own over the framing's) */
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {
            /* _step_fast's ``raise HTTPParseError(*exc.args) from None`` */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *exc_args = value == NULL ? NULL : PyObject_GetAttrString(value, "args");
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (exc_args == NULL)
                return NULL;
            PyObject *exc = PyObject_Call(self->parse_error, exc_args, NULL);
            Py_DECREF(exc_args);
            if (exc == NULL)
                return NULL;
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    return after_read(self, body_block, outn, seen, lag, (Py_ssize_t)got, rest);
}

/* fold(body, seen, lag, nraw): what a call does after its read, for a read given (a body whose
 * framing went on). */
static PyObject *FramedStep_fold(FramedStep *self, PyObject *args) {
    Py_buffer body;
    double seen, lag;
    Py_ssize_t nraw;
    if (!PyArg_ParseTuple(args, "y*ddn", &body, &seen, &lag, &nraw))
        return NULL;
    PyObject *out = after_read(self, body.buf, body.len, seen, lag, nraw, Py_NewRef(Py_None));
    PyBuffer_Release(&body);
    return out;
}

static PyObject *FramedStep_flush(FramedStep *self, PyObject *unused) {
    if (flush(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int FramedStep_init(FramedStep *self, PyObject *args, PyObject *kw) {
    PyObject *stream, *backlog, *parse_error;
    double burst_wait_ms, buckets_per_e;
    if (!PyArg_ParseTuple(args, "OOOdd:FramedStep", &stream, &backlog, &parse_error,
                          &burst_wait_ms, &buckets_per_e))
        return -1;
    long long fd;
    PyObject *fast = PyObject_GetAttr(stream, n_fast);
    if (fast == NULL)
        return -1;
    if (!PyObject_TypeCheck(fast, &ChunkedType)) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_TypeError, "FramedStep: the stream's fast is not a Chunked");
        return -1;
    }
    int ok = get_long(stream, n_fd, &fd);
    if (ok <= 0 || fd < 0 || fd > INT_MAX) {
        Py_DECREF(fast);
        if (ok >= 0)
            PyErr_SetString(PyExc_ValueError, "FramedStep: the stream has no socket");
        return -1;
    }
    PyObject *tally = PyObject_GetAttr(stream, n_tally);
    PyObject *sample = tally == NULL ? NULL : PyObject_GetAttr(tally, n_sample);
    PyObject *guard = sample == NULL ? NULL : PyObject_GetAttr(tally, n_guard);
    PyObject *resp = guard == NULL ? NULL : PyObject_GetAttr(stream, n_resp);
    PyObject *arrival = resp == NULL ? NULL : PyObject_GetAttr(stream, n_arrival);
    PyObject *parser = arrival == NULL ? NULL : PyObject_GetAttr(stream, n_parser);
    PyObject *read_rest = parser == NULL ? NULL : PyObject_GetAttr(stream, n_step_read);
    PyObject *step = read_rest == NULL ? NULL : PyObject_GetAttr(stream, n_step);
    if (step == NULL) {
        Py_DECREF(fast);
        Py_XDECREF(tally); Py_XDECREF(sample); Py_XDECREF(guard); Py_XDECREF(resp);
        Py_XDECREF(arrival); Py_XDECREF(parser); Py_XDECREF(read_rest);
        return -1;
    }
    Py_XSETREF(self->stream, Py_NewRef(stream));
    Py_XSETREF(self->fast, fast);
    Py_XSETREF(self->tally, tally);
    Py_XSETREF(self->sample, sample);
    Py_XSETREF(self->guard, guard);
    Py_XSETREF(self->resp, resp);
    Py_XSETREF(self->arrival, arrival);
    Py_XSETREF(self->parser, parser);
    Py_XSETREF(self->read_rest, read_rest);
    Py_XSETREF(self->step, step);
    Py_XSETREF(self->backlog, Py_NewRef(backlog));
    Py_XSETREF(self->parse_error, Py_NewRef(parse_error));
    self->fd = (int)fd;
    self->burst_wait_ms = burst_wait_ms;
    self->buckets_per_e = buckets_per_e;
    self->reads = self->folded = 0;
    self->hot = self->dirty = 0;
    self->itl_n = 0;
    return 0;
}

static void FramedStep_dealloc(FramedStep *self) {
    Py_XDECREF(self->stream); Py_XDECREF(self->fast); Py_XDECREF(self->resp);
    Py_XDECREF(self->tally); Py_XDECREF(self->sample); Py_XDECREF(self->arrival);
    Py_XDECREF(self->parser); Py_XDECREF(self->guard); Py_XDECREF(self->backlog);
    Py_XDECREF(self->parse_error); Py_XDECREF(self->read_rest); Py_XDECREF(self->step);
    Py_XDECREF(self->head); Py_XDECREF(self->tail); Py_XDECREF(self->itl);
    PyMem_Free(self->itl_buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef FramedStep_methods[] = {
    {"fold", (PyCFunction)FramedStep_fold, METH_VARARGS,
     "fold(body, seen, lag, nraw): what a call does after its read, for a read given"},
    {"flush", (PyCFunction)FramedStep_flush, METH_NOARGS,
     "flush(): the stream's state back into its Python objects (its reading ends)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef FramedStep_members[] = {
    {"reads", T_LONGLONG, offsetof(FramedStep, reads), READONLY, "reads made"},
    {"folded", T_LONGLONG, offsetof(FramedStep, folded), READONLY, "reads folded in here"},
    {"hot", T_INT, offsetof(FramedStep, hot), READONLY, "the stream's state is the step's"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FramedStepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "streamquake.loadgen._speedups.FramedStep",
    .tp_basicsize = sizeof(FramedStep),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The shared reader's step of one stream, its template reads folded in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FramedStep_init,
    .tp_dealloc = (destructor)FramedStep_dealloc,
    .tp_call = (ternaryfunc)FramedStep_call,
    .tp_methods = FramedStep_methods,
    .tp_members = FramedStep_members,
};

/* varints(counts) -> bytes: HdrHistogram V2's counts payload for a {index: count} dict, in
 * index order: ZigZag LEB128 counts, each run of empty buckets before one as a negative number
 * (histogram._varints_py, whose Python it stands in for). */
static int put_varint(char **p, uint64_t v) {
    while (v > 0x7F) {
        *(*p)++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *(*p)++ = (char)v;
    return 0;
}

typedef struct {
    long long index, count;
} Bucket;

/* Buckets in index order: an insertion sort for a few; else an LSD radix sort on the index,
 * a byte a pass, as many passes as the largest index has bytes (a histogram's indexes take 2
 * or 3: qsort's calls to a comparator took most of a checkpoint's encoding). -1 where memory
 * ran out. */
static int sort_buckets(Bucket *b, Py_ssize_t n) {
    if (n < 32) {
        for (Py_ssize_t i = 1; i < n; i++) {
            Bucket x = b[i];
            Py_ssize_t j = i;
            for (; j > 0 && b[j - 1].index > x.index; j--)
                b[j] = b[j - 1];
            b[j] = x;
        }
        return 0;
    }
    unsigned long long top = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        top |= (unsigned long long)b[i].index;
    Bucket *tmp = PyMem_Malloc((size_t)n * sizeof(Bucket));
    if (tmp == NULL)
        return -1;
    Bucket *from = b, *to = tmp;
    for (int shift = 0; shift < 64 && (top >> shift) != 0; shift += 8) {
        Py_ssize_t count[257] = {0};
        for (Py_ssize_t i = 0; i < n; i++)
            count[((unsigned long long)from[i].index >> shift & 0xFF) + 1]++;
        for (int k = 0; k < 256; k++)
            count[k + 1] += count[k];
        for (Py_ssize_t i = 0; i < n; i++)
            to[count[(unsigned long long)from[i].index >> shift & 0xFF]++] = from[i];
        Bucket *t = from;
        from = to;
        to = t;
    }
    if (from != b)
        memcpy(b, from, (size_t)n * sizeof(Bucket));
    PyMem_Free(tmp);
    return 0;
}

/* A {key: count} dict's items in key order (PyMem_Free them); NULL with an exception set
 * for anything but a dict of ints from 0 to ``top``. */
static Bucket *sorted_items(PyObject *arg, long long top, Py_ssize_t *n) {
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "a dict of counts");
        return NULL;
    }
    Py_ssize_t pos = 0, i = 0;
    *n = PyDict_GET_SIZE(arg);
    Bucket *buckets = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(Bucket));
    if (buckets == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject *key, *value;
    while (PyDict_Next(arg, &pos, &key, &value)) {
        long long index = PyLong_AsLongLong(key), count = PyLong_AsLongLong(value);
        if ((index == -1 || count == -1) && PyErr_Occurred())
            goto fail;
        if (index < 0 || index > top || count < 0 || count > top) {
            PyErr_Format(PyExc_ValueError, "keys and counts from 0 to %lld", top);
            goto fail;
        }
        buckets[i].index = index;
        buckets[i].count = count;
        i++;
    }
    if (sort_buckets(buckets, *n) < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    return buckets;
fail:
    PyMem_Free(buckets);
    return NULL;
}

/* pairs_le32(table) -> bytes: a {key: count} dict's pairs in key order, each key then its count
 * as little-endian uint32s (histogram.pack_pairs, before its base64). */
static PyObject *pairs_le32(PyObject *self, PyObject *arg) {
    Py_ssize_t n;
    Bucket *buckets = sorted_items(arg, 0xFFFFFFFFLL, &n);
    if (buckets == NULL)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL) {
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t kv[2] = {(uint32_t)buckets[i].index, (uint32_t)buckets[i].count};
            for (int j = 0; j < 2; j++) {
                p[0] = kv[j] & 0xFF;
                p[1] = (kv[j] >> 8) & 0xFF;
                p[2] = (kv[j] >> 16) & 0xFF;
                p[3] = kv[j] >> 24;
                p += 4;
            }
        }
    }
    PyMem_Free(buckets);
    return out;
}

static PyObject *varints(PyObject *self, PyObject *arg) {
    Py_ssize_t n, i;
    PyObject *out = NULL;
    Bucket *buckets = sorted_items(arg, 1LL << 61, &n);
    if (buckets == NULL)
        return NULL;
    /* at most two varints of 10 bytes a bucket */
    out = PyBytes_FromStringAndSize(NULL, n * 20);
    if (out == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(out);
    long long prev = -1;
    for (i = 0; i < n; i++) {
        long long gap = buckets[i].index - prev - 1;
        if (gap)
            put_varint(&p, ((uint64_t)gap << 1) - 1);
        put_varint(&p, (uint64_t)buckets[i].count << 1);
        prev = buckets[i].index;
    }
    if (_PyBytes_Resize(&out, p - PyBytes_AS_STRING(out)) < 0)
        out = NULL;
done:
    PyMem_Free(buckets);
    return out;
}

/* read_round(epfd, steps, max) -> (reads, outcomes): reader.Reader._round's loop. The sockets
 * epoll says are ready (``max`` at most, without waiting), each read once by its step (``steps``:
 * fd -> (step, waiter)); ``outcomes`` lists what is not None: (fd, value, None) for a step's
 * end or BACKLOG, (fd, None, exception) for a step that raised an Exception (BlockingIOError:
 * nothing after all, skipped). Anything else raised (not an Exception) is raised from here.
 * ``reads`` counts the steps called (reader.Reader._read_round, whose Python it stands in for). */
#define ROUND_EVENTS 256
static PyObject *read_round(PyObject *self, PyObject *args) {
    int epfd, max;
    PyObject *steps;
    if (!PyArg_ParseTuple(args, "iO!i", &epfd, &PyDict_Type, &steps, &max))
        return NULL;
    if (max < 1 || max > ROUND_EVENTS) {
        PyErr_Format(PyExc_ValueError, "max from 1 to %d", ROUND_EVENTS);
        return NULL;
    }
    struct epoll_event events[ROUND_EVENTS];
    int n = epoll_wait(epfd, events, max, 0);
    if (n < 0) {
        if (errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        n = 0;
    }
    long reads = 0;
    PyObject *outcomes = PyList_New(0);
    if (outcomes == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *key = PyLong_FromLong(events[i].data.fd);
        if (key == NULL)
            goto fail;
        PyObject *entry = PyDict_GetItemWithError(steps, key);     /* borrowed */
        Py_DECREF(key);
        if (entry == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 1) {
            PyErr_SetString(PyExc_TypeError, "a step entry is (step, waiter)");
            goto fail;
        }
        Py_INCREF(entry);       /* the step may drop its own entry */
        reads++;
        PyObject *got = PyObject_CallNoArgs(PyTuple_GET_ITEM(entry, 0));
        Py_DECREF(entry);
        PyObject *outcome;
        if (got == NULL) {
            if (PyErr_ExceptionMatches(PyExc_BlockingIOError)) {
                PyErr_Clear();
                continue;
            }
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                goto fail;
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            if (value == NULL)
                goto fail;
            outcome = Py_BuildValue("(iOO)", events[i].data.fd, Py_None, value);
            Py_DECREF(value);
        } else if (got == Py_None) {
            Py_DECREF(got);
            continue;
        } else {
            outcome = Py_BuildValue("(iOO)", events[i].data.fd, got, Py_None);
            Py_DECREF(got);
        }
        if (outcome == NULL || PyList_Append(outcomes, outcome) < 0) {
            Py_XDECREF(outcome);
            goto fail;
        }
        Py_DECREF(outcome);
    }
    PyObject *out = Py_BuildValue("(lO)", reads, outcomes);
    Py_DECREF(outcomes);
    return out;
fail:
    Py_DECREF(outcomes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"count_ms", count_ms, METH_VARARGS,
     "count_ms(counts, values, mask, unit, half_magnitude, half, base) -> n: histogram.count_ms"},
    {"framed_events", (PyCFunction)(void (*)(void))framed_events, METH_FASTCALL,
     "framed_events(read, head, tail) -> (k, end): the read's leading k template events"},
    {"pairs_le32", pairs_le32, METH_O,
     "pairs_le32(table) -> bytes: a dict's (key, count) pairs in key order, uint32 LE each"},
    {"varints", varints, METH_O,
     "varints(counts) -> bytes: HdrHistogram V2's counts payload of an {index: count} dict"},
    {"read_round", read_round, METH_VARARGS,
     "read_round(epfd, steps, max) -> (reads, outcomes): one round of the shared reader"},
    {"recv_stamped", recv_stamped, METH_VARARGS,
     "recv_stamped(fd, size) -> (data, seen, lag): one stamped read that never waits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "Compiled twins of the load process's hot loops (see speedups.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&ChunkedType) < 0 || PyType_Ready(&FramedStepType) < 0 ||
        intern_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Chunked", (PyObject *)&ChunkedType) < 0 ||
        PyModule_AddObjectRef(m, "FramedStep", (PyObject *)&FramedStepType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
