/*
 * FP and vector registers must survive context switches inside User-Mode Linux, where every
 * switch saves and restores them through ptrace (NT_X86_XSTATE) and, on hosts with AMX, through
 * scripts/uml_xstate_shim.c. Several processes run tight loops that keep their state in x87,
 * SSE, AVX (ymm) and, where the CPU has it, AVX-512 (zmm) registers, with no system call inside
 * the loops, so the guest kernel preempts them mid-computation many times. Each prints the exact
 * bits of its results and how often it was preempted; tests/test_uml_xstate.py compares the bits
 * with the same program's run on the host.
 *
 *   fp_roundtrip PROCS ITERATIONS
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

typedef double v2d __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

static uint64_t bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* Two running sums per lane: x grows by c, y by x * m. Neither forgets (no contraction towards a
 * fixed point), and every step rounds, so one wrong bit in any register at any time shows in the
 * result. Eight accumulators (four x, four y) keep eight registers live through the loop. */
#define STEP(x, y, m, c) ((x) += (c), (y) += (x) * (m))

static uint64_t run_x87(long n, double seed) {
    long double a[4] = {seed, seed + 0.25L, seed + 0.5L, seed + 0.75L};
    long double b[4] = {0, 0, 0, 0};
    const long double m = 0.000000119L, c = 0.000000731L;
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            STEP(a[k], b[k], m, c);
    return bits((double)(a[0] + a[1] * 3 + a[2] * 5 + a[3] * 7 + b[0] + b[1] * 3 + b[2] * 5 + b[3] * 7));
}

__attribute__((target("sse2"))) static uint64_t run_sse(long n, double seed) {
    v2d a[8];
    const v2d m = {0.000000119, 0.000000121}, c = {0.000000731, 0.000000733};
    for (int k = 0; k < 8; k++)
        a[k] = (v2d){seed + k * 0.01, seed + k * 0.02};
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            STEP(a[k], a[k + 4], m, c);
    double s = 0;
    for (int k = 0; k < 8; k++)
        s += a[k][0] * (k + 1) + a[k][1] * (k + 3);
    return bits(s);
}

__attribute__((target("avx"))) static uint64_t run_avx(long n, double seed) {
    v4d a[8];
    const v4d m = {0.000000119, 0.000000121, 0.000000123, 0.000000127};
    const v4d c = {0.000000731, 0.000000733, 0.000000737, 0.000000739};
    for (int k = 0; k < 8; k++)
        a[k] = (v4d){seed + k * 0.01, seed + k * 0.02, seed + k * 0.03, seed + k * 0.04};
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            STEP(a[k], a[k + 4], m, c);
    double s = 0;
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 4; j++)
            s += a[k][j] * (k + j + 1);
    return bits(s);
}

__attribute__((target("avx512f"))) static uint64_t run_avx512(long n, double seed) {
    v8d a[8];
    v8d m, c;
    for (int j = 0; j < 8; j++) {
        m[j] = 0.000000119 + j * 0.000000002;
        c[j] = 0.000000731 + j * 0.000000002;
    }
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 8; j++)
            a[k][j] = seed + k * 0.01 + j * 0.001;
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            STEP(a[k], a[k + 4], m, c);
    double s = 0;
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 8; j++)
            s += a[k][j] * (k + j + 1);
    return bits(s);
}

static void child(int id, long n) {
    double seed = 0.1 + id * 0.037;
    uint64_t x87 = run_x87(n, seed), sse = run_sse(n, seed), avx = 0, avx512 = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx"))
        avx = run_avx(n, seed);
    if (__builtin_cpu_supports("avx512f"))
        avx512 = run_avx512(n, seed);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("proc %d x87=%016llx sse=%016llx avx=%016llx avx512=%016llx preempted=%ld\n", id,
           (unsigned long long)x87, (unsigned long long)sse, (unsigned long long)avx,
           (unsigned long long)avx512, ru.ru_nivcsw);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PROCS ITERATIONS\n", argv[0]);
        return 2;
    }
    int procs = atoi(argv[1]);
    long n = atol(argv[2]);
    for (int i = 0; i < procs; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) {
            child(i, n);
            _exit(0);
        }
    }
    int failed = 0, status;
    while (wait(&status) > 0)
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    return failed;
}
