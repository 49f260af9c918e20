/*
 * uml_xstate_shim.c: an LD_PRELOAD library that lets Debian's User-Mode Linux (linux.uml 6.1)
 * boot on hosts whose XSAVE area is larger than UML's FP register buffer (CPUs with AMX: about
 * 11 KB). scripts/uml-run preloads it into linux.uml; it changes nothing anywhere else.
 *
 * Why: the host kernel's xstateregs_set() accepts PTRACE_SETREGSET with NT_X86_XSTATE only for a
 * buffer of exactly its full user XSAVE size and answers EFAULT otherwise. UML passes its own,
 * compile-time sized buffer, so on such a host its first context switch fails with "userspace -
 * ptrace set fp regs failed, errno = 14" and the kernel panics before init.
 *
 * What: libc's ptrace() is wrapped. For PTRACE_GETREGSET / PTRACE_SETREGSET on NT_X86_XSTATE
 * with a buffer shorter than the host's size (found by asking the kernel once: a GETREGSET with
 * a large buffer comes back with the exact size), the task's full state is read into a buffer of
 * the host's size;
 *   GET: UML gets the first bytes that fit its buffer, with the header's XSTATE_BV masked to the
 *        features whose area lies wholly inside that buffer;
 *   SET: UML's bytes are laid over the full state; features that fit take UML's XSTATE_BV bits,
 *        the rest keep the task's own, and the full buffer goes to the kernel.
 * Every other call goes straight to libc. The state of features beyond UML's buffer (AVX-512's
 * upper registers, AMX tiles) is not kept per guest task, exactly as in UML without this shim on
 * a host where the sizes match: UML does not know those features exist.
 *
 * UML_XSTATE_SHIM=force takes the full-buffer path for every such call, even where UML's buffer
 * is already large enough (Debian's 6.1um4 passes 2696 bytes: enough for AVX-512, not for AMX), so that the path AMX hosts take can be exercised on any host.
 * UML_XSTATE_SHIM=off turns the shim into a plain pass-through.
 * On its first intervention it prints one line to stderr, so a run shows that it acted.
 *
 * Only UML's tracer thread calls these requests, one at a time, so one static buffer is enough.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/types.h>
#include <sys/uio.h>

#ifndef NT_X86_XSTATE
#define NT_X86_XSTATE 0x202
#endif

#define LEGACY_SIZE 512     /* FXSAVE area: x87 and SSE (features 0 and 1) */
#define HEADER_SIZE 64      /* XSAVE header: XSTATE_BV, XCOMP_BV, reserved */
#define MAX_XSTATE (64 * 1024)

typedef long (*ptrace_fn)(enum __ptrace_request, pid_t, void *, void *);

static unsigned char full_buf[MAX_XSTATE] __attribute__((aligned(64)));
static size_t host_size;    /* 0: not asked yet */
static int mode = -1;       /* 0 off, 1 auto, 2 force */
static int announced;

static ptrace_fn real_ptrace(void) {
    static ptrace_fn fn;
    if (!fn)
        fn = (ptrace_fn)dlsym(RTLD_NEXT, "ptrace");
    return fn;
}

static int shim_mode(void) {
    if (mode < 0) {
        const char *v = getenv("UML_XSTATE_SHIM");
        mode = (v && !strcmp(v, "off")) ? 0 : (v && !strcmp(v, "force")) ? 2 : 1;
    }
    return mode;
}

/* The kernel's own full size for this task's regset; 0 when it cannot be read. */
static size_t ask_host_size(pid_t pid) {
    struct iovec iov = {full_buf, sizeof full_buf};
    int saved = errno;
    long rc = real_ptrace()(PTRACE_GETREGSET, pid, (void *)(uintptr_t)NT_X86_XSTATE, &iov);
    errno = saved;
    return rc == 0 ? iov.iov_len : 0;
}

/* XSTATE_BV bits of the user features whose whole area lies inside the first len bytes. CPUID
 * is a VM exit under virtualisation, so the layout is read once. */
static uint64_t features_within(size_t len) {
    static unsigned end[64]; /* offset + size of each user feature's area; 0: none */
    static int layout_read;
    uint64_t mask = 0;
    unsigned eax, ebx, ecx, edx;
    if (!layout_read) {
        layout_read = 1;
        for (unsigned i = 2; i < 63; i++)
            if (__get_cpuid_count(0xd, i, &eax, &ebx, &ecx, &edx) && eax && !(ecx & 1))
                end[i] = ebx + eax; /* ECX bit 0: supervisor state, never in this buffer */
    }
    if (len >= LEGACY_SIZE + HEADER_SIZE)
        mask |= 3; /* x87, SSE: in the legacy area */
    for (unsigned i = 2; i < 63; i++)
        if (end[i] && end[i] <= len)
            mask |= 1ULL << i;
    return mask;
}

static void announce(size_t uml_len) {
    if (announced)
        return;
    announced = 1;
    fprintf(stderr, "uml-xstate-shim: %s: NT_X86_XSTATE buffers of %zu bytes passed as %zu "
            "(the host's XSAVE size)\n", mode == 2 ? "forced" : "active", uml_len, host_size);
}

static long regset_padded(enum __ptrace_request req, pid_t pid, struct iovec *iov) {
    size_t len = iov->iov_len < host_size ? iov->iov_len : host_size;
    struct iovec full = {full_buf, host_size};
    long rc;
    uint64_t fit, uml_bv, task_bv;

    memset(full_buf, 0, host_size);
    rc = real_ptrace()(PTRACE_GETREGSET, pid, (void *)(uintptr_t)NT_X86_XSTATE, &full);
    if (rc < 0)
        return rc;
    fit = features_within(len);
    announce(iov->iov_len);
    if (req == PTRACE_GETREGSET) {
        memcpy(&task_bv, full_buf + LEGACY_SIZE, sizeof task_bv);
        task_bv &= fit;
        memcpy(iov->iov_base, full_buf, len);
        memcpy((unsigned char *)iov->iov_base + LEGACY_SIZE, &task_bv, sizeof task_bv);
        iov->iov_len = len; /* as the kernel does: the bytes written */
        return 0;
    }
    memcpy(&task_bv, full_buf + LEGACY_SIZE, sizeof task_bv);
    memcpy(&uml_bv, (unsigned char *)iov->iov_base + LEGACY_SIZE, sizeof uml_bv);
    memcpy(full_buf, iov->iov_base, len);
    uml_bv = (uml_bv & fit) | (task_bv & ~fit);
    memcpy(full_buf + LEGACY_SIZE, &uml_bv, sizeof uml_bv);
    full.iov_len = host_size;
    return real_ptrace()(PTRACE_SETREGSET, pid, (void *)(uintptr_t)NT_X86_XSTATE, &full);
}

long ptrace(enum __ptrace_request req, ...) {
    va_list ap;
    pid_t pid;
    void *addr, *data;

    va_start(ap, req);
    pid = va_arg(ap, pid_t);
    addr = va_arg(ap, void *);
    data = va_arg(ap, void *);
    va_end(ap);

    if ((req == PTRACE_GETREGSET || req == PTRACE_SETREGSET) &&
        (uintptr_t)addr == NT_X86_XSTATE && data && shim_mode() != 0) {
        struct iovec *iov = data;
        if (!host_size)
            host_size = ask_host_size(pid);
        if (host_size && host_size <= sizeof full_buf &&
            iov->iov_len >= LEGACY_SIZE + HEADER_SIZE &&
            (iov->iov_len < host_size || mode == 2))
            return regset_padded(req, pid, iov);
    }
    return real_ptrace()(req, pid, addr, data);
}
