/*
 * An emulated NVIDIA driver: the subset of libnvidia-ml.so.1 that streamquake calls.
 *
 * Build:  gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 * Use:    LD_LIBRARY_PATH=<dir holding it> FAKE_NVML_STATE=/path/state.txt <process>
 *
 * Why a file: real locked clocks outlive the process that set them, so the emulated ones must
 * too. Every call re-reads the file; every setter rewrites it under an flock on "<file>.lock"
 * (write to a temp file, then rename) so concurrent readers never see a torn file.
 *
 * Thread-safe: the parse buffers are thread-local, as pynvml calls from several threads.
 *
 * File format: one "key=value" per line. A key "gpuN.key" overrides "key" for GPU N.
 *   gpu_count=2                    number of GPUs (default 1)
 *   name; gpuN.uuid                strings (defaults: H100-like name, GPU-fa4e...-0000000000N)
 *   arch=9                         nvmlDeviceArchitecture_t (4 Pascal, 5 Volta, 7 Ampere, 9 Hopper)
 *   max_sm_mhz=1980 min_sm_mhz=345 sm_step_mhz=15   supported graphics clocks, descending
 *   mem_clocks=2619                comma list of supported memory clocks, descending
 *   default_power_mw=700000 min_power_mw=200000 max_power_mw=700000
 *   power_draw_mw=350000 temp_c=45 util_gpu=37 util_mem=12 mem_total_mib=81559 mem_used_mib=1024
 *   reasons=0x0                    extra clock-event-reason bits, OR-ed in
 * Mutable (written by the setters):
 *   gpuN.sm_lock=MIN,MAX  gpuN.mem_lock=MIN,MAX  gpuN.power_mw=LIMIT   (absent = default)
 * Failures:
 *   gpuN.lost=1                    every call on that GPU returns NVML_ERROR_GPU_IS_LOST
 *   fail.<nvmlFunctionName>=<code> that function returns <code> (also per GPU: gpuN.fail.<fn>)
 *   require_root=1                 setters return NVML_ERROR_NO_PERMISSION unless euid 0
 *   no_permission=1                setters always return NVML_ERROR_NO_PERMISSION
 * Without FAKE_NVML_STATE, init returns NVML_ERROR_DRIVER_NOT_LOADED.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct { int index; } fake_device;
typedef fake_device *nvmlDevice_t;
typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NO_PERMISSION = 4, NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_UNKNOWN = 999
};
enum { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2, NVML_CLOCK_VIDEO = 3 };
enum { ARCH_VOLTA = 5, ARCH_AMPERE = 7, ARCH_HOPPER = 9 };
#define REASON_GPU_IDLE 0x1ULL
#define REASON_APP_CLOCKS 0x2ULL
#define REASON_SW_POWER_CAP 0x4ULL

#define MAX_GPUS 64
#define MAX_LINES 256
#define LINE_LEN 128

static fake_device g_devices[MAX_GPUS];
static int g_initialized;

/* ---- state file ---------------------------------------------------------------------- */

typedef struct {
    int n;
    char key[MAX_LINES][LINE_LEN];
    char val[MAX_LINES][LINE_LEN];
} kv_t;

/* Truncating copy into a LINE_LEN slot (long keys or values are cut, never overflow). */
static void put(char *dst, const char *src) {
    size_t n = strnlen(src, LINE_LEN - 1);
    memcpy(dst, src, n);
    dst[n] = 0;
}

static const char *state_path(void) { return getenv("FAKE_NVML_STATE"); }

static void kv_load(kv_t *kv) {
    kv->n = 0;
    const char *path = state_path();
    if (!path) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[2 * LINE_LEN];
    while (kv->n < MAX_LINES && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq || line[0] == '#') continue;
        *eq = 0;
        put(kv->key[kv->n], line);
        put(kv->val[kv->n], eq + 1);
        kv->n++;
    }
    fclose(f);
}

static const char *kv_raw(const kv_t *kv, const char *key) {
    for (int i = kv->n - 1; i >= 0; i--)
        if (strcmp(kv->key[i], key) == 0) return kv->val[i];
    return NULL;
}

/* "gpuN.key" first, then "key". */
static const char *kv_get(const kv_t *kv, int gpu, const char *key) {
    char k[LINE_LEN];
    if (gpu >= 0) {
        snprintf(k, sizeof k, "gpu%d.%s", gpu, key);
        const char *v = kv_raw(kv, k);
        if (v) return v;
    }
    return kv_raw(kv, key);
}

static long long kv_int(const kv_t *kv, int gpu, const char *key, long long dflt) {
    const char *v = kv_get(kv, gpu, key);
    return v && *v ? strtoll(v, NULL, 0) : dflt;
}

static int kv_pair(const kv_t *kv, int gpu, const char *key, unsigned *lo, unsigned *hi) {
    const char *v = kv_get(kv, gpu, key);
    return v && sscanf(v, "%u,%u", lo, hi) == 2;
}

static void kv_set(kv_t *kv, const char *key, const char *val) {
    for (int i = 0; i < kv->n; i++) {
        if (strcmp(kv->key[i], key) == 0) {
            put(kv->val[i], val);
            return;
        }
    }
    if (kv->n >= MAX_LINES) return;
    put(kv->key[kv->n], key);
    put(kv->val[kv->n], val);
    kv->n++;
}

static void kv_del(kv_t *kv, const char *key) {
    for (int i = 0; i < kv->n; i++) {
        if (strcmp(kv->key[i], key) == 0) {
            for (int j = i; j < kv->n - 1; j++) {
                memcpy(kv->key[j], kv->key[j + 1], LINE_LEN);
                memcpy(kv->val[j], kv->val[j + 1], LINE_LEN);
            }
            kv->n--;
            i--;
        }
    }
}

/* Read-modify-write of one GPU key under the lock; val NULL deletes it. */
static nvmlReturn_t state_update(int gpu, const char *key, const char *val) {
    const char *path = state_path();
    if (!path) return NVML_ERROR_DRIVER_NOT_LOADED;
    char lock_path[4096], tmp_path[4096], k[LINE_LEN];
    snprintf(lock_path, sizeof lock_path, "%s.lock", path);
    snprintf(tmp_path, sizeof tmp_path, "%s.tmp.%d", path, (int)getpid());
    snprintf(k, sizeof k, "gpu%d.%s", gpu, key);
    int lfd = open(lock_path, O_RDWR | O_CREAT, 0644);
    if (lfd < 0) return NVML_ERROR_UNKNOWN;
    flock(lfd, LOCK_EX);
    static __thread kv_t kv; /* 64 KiB: off the stack, one per thread */
    kv_load(&kv);
    if (val) kv_set(&kv, k, val); else kv_del(&kv, k);
    nvmlReturn_t rc = NVML_SUCCESS;
    FILE *f = fopen(tmp_path, "w");
    if (!f) {
        rc = NVML_ERROR_UNKNOWN;
    } else {
        for (int i = 0; i < kv.n; i++) fprintf(f, "%s=%s\n", kv.key[i], kv.val[i]);
        fflush(f);
        fsync(fileno(f));
        fclose(f);
        if (rename(tmp_path, path) != 0) rc = NVML_ERROR_UNKNOWN;
    }
    flock(lfd, LOCK_UN);
    close(lfd);
    return rc;
}

/* ---- device model ------------------------------------------------------------------------ */

typedef struct {
    int idx;
    unsigned max_sm, min_sm, step_sm;
    unsigned mem_clocks[32];
    int n_mem;
    int arch;
} model_t;

static void model_load(const kv_t *kv, int idx, model_t *m) {
    m->idx = idx;
    m->max_sm = (unsigned)kv_int(kv, idx, "max_sm_mhz", 1980);
    m->min_sm = (unsigned)kv_int(kv, idx, "min_sm_mhz", 345);
    m->step_sm = (unsigned)kv_int(kv, idx, "sm_step_mhz", 15);
    if (m->step_sm == 0) m->step_sm = 15;
    m->arch = (int)kv_int(kv, idx, "arch", ARCH_HOPPER);
    const char *mc = kv_get(kv, idx, "mem_clocks");
    if (!mc) mc = "2619";
    char buf[LINE_LEN];
    snprintf(buf, sizeof buf, "%s", mc);
    m->n_mem = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok && m->n_mem < 32;
         tok = strtok_r(NULL, ",", &save))
        m->mem_clocks[m->n_mem++] = (unsigned)strtoul(tok, NULL, 0);
}

static unsigned max_mem(const model_t *m) {
    unsigned best = 0;
    for (int i = 0; i < m->n_mem; i++) if (m->mem_clocks[i] > best) best = m->mem_clocks[i];
    return best;
}

static unsigned min_mem(const model_t *m) {
    unsigned best = max_mem(m);
    for (int i = 0; i < m->n_mem; i++) if (m->mem_clocks[i] < best) best = m->mem_clocks[i];
    return best;
}

/* Like the real driver: run at the highest supported clock inside the locked window. */
static unsigned current_sm(const kv_t *kv, const model_t *m) {
    unsigned lo, hi, clock = m->max_sm;
    if (kv_pair(kv, m->idx, "sm_lock", &lo, &hi)) {
        unsigned top = hi < m->max_sm ? hi : m->max_sm;
        unsigned steps = (m->max_sm - top + m->step_sm - 1) / m->step_sm;
        clock = m->max_sm - steps * m->step_sm;
        if (clock < lo) clock = lo;
    }
    long long def = kv_int(kv, m->idx, "default_power_mw", 700000);
    long long lim = kv_int(kv, m->idx, "power_mw", def);
    long long draw = kv_int(kv, m->idx, "power_draw_mw", 350000);
    if (draw > lim && lim > 0) {
        /* A power cap below the draw the workload wants costs clock speed roughly linearly. */
        unsigned capped = (unsigned)((unsigned long long)m->max_sm * lim / draw);
        if (capped < clock) clock = capped < m->min_sm ? m->min_sm : capped;
    }
    return clock;
}

static unsigned current_mem(const kv_t *kv, const model_t *m) {
    unsigned lo, hi, best = 0;
    if (!kv_pair(kv, m->idx, "mem_lock", &lo, &hi)) return max_mem(m);
    for (int i = 0; i < m->n_mem; i++)
        if (m->mem_clocks[i] <= hi && m->mem_clocks[i] >= lo && m->mem_clocks[i] > best)
            best = m->mem_clocks[i];
    return best ? best : lo;
}

/* ---- common checks ----------------------------------------------------------------------- */

static nvmlReturn_t forced_failure(const kv_t *kv, int gpu, const char *fn) {
    char k[LINE_LEN];
    snprintf(k, sizeof k, "fail.%s", fn);
    return (nvmlReturn_t)kv_int(kv, gpu, k, NVML_SUCCESS);
}

/* Loads state and validates the handle; returns the device index or a negative error. */
static nvmlReturn_t enter(nvmlDevice_t dev, const char *fn, kv_t *kv, int *idx) {
    if (!g_initialized) return NVML_ERROR_UNINITIALIZED;
    kv_load(kv);
    if (dev < g_devices || dev >= g_devices + MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    *idx = dev->index;
    if (*idx >= kv_int(kv, -1, "gpu_count", 1)) return NVML_ERROR_INVALID_ARGUMENT;
    if (kv_int(kv, *idx, "lost", 0)) return NVML_ERROR_GPU_IS_LOST;
    return forced_failure(kv, *idx, fn);
}

static nvmlReturn_t may_set(const kv_t *kv, int idx) {
    if (kv_int(kv, idx, "no_permission", 0)) return NVML_ERROR_NO_PERMISSION;
    if (kv_int(kv, idx, "require_root", 0) && geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    return NVML_SUCCESS;
}

/* One parse buffer per thread, shared by the API calls (none of which nest). */
static __thread kv_t g_kv;

#define ENTER(dev, name)                                  \
    kv_t *const kv = &g_kv;                               \
    int idx;                                              \
    nvmlReturn_t rc_ = enter((dev), (name), kv, &idx);    \
    if (rc_ != NVML_SUCCESS) return rc_

/* ---- the API ----------------------------------------------------------------------------- */

int fakeNvmlIsEmulated(void) { return 1; }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (!state_path()) return NVML_ERROR_DRIVER_NOT_LOADED;
    kv_t *const kv = &g_kv;
    kv_load(kv);
    nvmlReturn_t rc = forced_failure(kv, -1, "nvmlInit");
    if (rc != NVML_SUCCESS) return rc;
    for (int i = 0; i < MAX_GPUS; i++) g_devices[i].index = i;
    __atomic_add_fetch(&g_initialized, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    int n = __atomic_load_n(&g_initialized, __ATOMIC_SEQ_CST);
    while (n > 0 && !__atomic_compare_exchange_n(&g_initialized, &n, n - 1, 0, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
    }
    return n > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!g_initialized) return NVML_ERROR_UNINITIALIZED;
    if (!version || length < 16) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "550.54.15-fake");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!g_initialized) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    kv_t *const kv = &g_kv;
    kv_load(kv);
    long long n = kv_int(kv, -1, "gpu_count", 1);
    *count = (unsigned)(n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : n);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!g_initialized) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    kv_t *const kv = &g_kv;
    kv_load(kv);
    if (index >= (unsigned)kv_int(kv, -1, "gpu_count", 1)) return NVML_ERROR_INVALID_ARGUMENT;
    if (kv_int(kv, (int)index, "lost", 0)) return NVML_ERROR_GPU_IS_LOST;
    *device = &g_devices[index];
    return NVML_SUCCESS;
}

static void uuid_of(const kv_t *kv, int idx, char *out, size_t len) {
    char k[LINE_LEN];
    snprintf(k, sizeof k, "gpu%d.uuid", idx);
    const char *u = kv_raw(kv, k); /* per GPU only: two GPUs never share a UUID */
    if (u) snprintf(out, len, "%s", u);
    else snprintf(out, len, "GPU-fa4e0000-5eed-4c1a-9e57-%012d", idx);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!g_initialized) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    kv_t *const kv = &g_kv;
    kv_load(kv);
    int n = (int)kv_int(kv, -1, "gpu_count", 1);
    char u[LINE_LEN];
    for (int i = 0; i < n && i < MAX_GPUS; i++) {
        uuid_of(kv, i, u, sizeof u);
        if (strcmp(u, uuid) == 0) {
            if (kv_int(kv, i, "lost", 0)) return NVML_ERROR_GPU_IS_LOST;
            *device = &g_devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index) {
    ENTER(dev, "nvmlDeviceGetIndex");
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)idx;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    ENTER(dev, "nvmlDeviceGetName");
    const char *n = kv_get(kv, idx, "name");
    if (!n) n = "NVIDIA H100 80GB HBM3 (emulated)";
    if (!name || length <= strlen(n)) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(name, length, "%s", n);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    ENTER(dev, "nvmlDeviceGetUUID");
    char u[LINE_LEN];
    uuid_of(kv, idx, u, sizeof u);
    if (!uuid || length <= strlen(u)) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(uuid, length, "%s", u);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t dev, unsigned int *arch) {
    ENTER(dev, "nvmlDeviceGetArchitecture");
    if (!arch) return NVML_ERROR_INVALID_ARGUMENT;
    *arch = (unsigned)kv_int(kv, idx, "arch", ARCH_HOPPER);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t dev, int type, unsigned int *clock) {
    ENTER(dev, "nvmlDeviceGetClockInfo");
    if (!clock) return NVML_ERROR_INVALID_ARGUMENT;
    model_t m;
    model_load(kv, idx, &m);
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: *clock = current_sm(kv, &m); return NVML_SUCCESS;
    case NVML_CLOCK_MEM: *clock = current_mem(kv, &m); return NVML_SUCCESS;
    case NVML_CLOCK_VIDEO: *clock = current_sm(kv, &m) * 9 / 10; return NVML_SUCCESS;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t dev, int type, unsigned int *clock) {
    ENTER(dev, "nvmlDeviceGetMaxClockInfo");
    if (!clock) return NVML_ERROR_INVALID_ARGUMENT;
    model_t m;
    model_load(kv, idx, &m);
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: *clock = m.max_sm; return NVML_SUCCESS;
    case NVML_CLOCK_MEM: *clock = max_mem(&m); return NVML_SUCCESS;
    case NVML_CLOCK_VIDEO: *clock = m.max_sm * 9 / 10; return NVML_SUCCESS;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
}

/* NVML's two-call protocol: *count too small -> INSUFFICIENT_SIZE with the needed count. */
static nvmlReturn_t fill(unsigned *count, unsigned *out, const unsigned *values, unsigned n) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < n || !out) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    memcpy(out, values, n * sizeof *values);
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t dev, unsigned *count, unsigned *out) {
    ENTER(dev, "nvmlDeviceGetSupportedMemoryClocks");
    model_t m;
    model_load(kv, idx, &m);
    return fill(count, out, m.mem_clocks, (unsigned)m.n_mem);
}

nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t dev, unsigned mem_mhz,
                                                  unsigned *count, unsigned *out) {
    ENTER(dev, "nvmlDeviceGetSupportedGraphicsClocks");
    model_t m;
    model_load(kv, idx, &m);
    int known = 0;
    for (int i = 0; i < m.n_mem; i++) known |= m.mem_clocks[i] == mem_mhz;
    if (!known) return NVML_ERROR_NOT_FOUND;
    unsigned values[4096], n = 0;
    for (unsigned c = m.max_sm; c >= m.min_sm && n < 4096; c -= m.step_sm) {
        values[n++] = c;
        if (c < m.step_sm) break;
    }
    return fill(count, out, values, n);
}

nvmlReturn_t nvmlDeviceSetGpuLockedClocks(nvmlDevice_t dev, unsigned lo, unsigned hi) {
    ENTER(dev, "nvmlDeviceSetGpuLockedClocks");
    if (kv_int(kv, idx, "arch", ARCH_HOPPER) < ARCH_VOLTA) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = may_set(kv, idx);
    if (rc != NVML_SUCCESS) return rc;
    model_t m;
    model_load(kv, idx, &m);
    if (lo > hi || lo < m.min_sm || hi > m.max_sm) return NVML_ERROR_INVALID_ARGUMENT;
    char v[64];
    snprintf(v, sizeof v, "%u,%u", lo, hi);
    return state_update(idx, "sm_lock", v);
}

nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t dev) {
    ENTER(dev, "nvmlDeviceResetGpuLockedClocks");
    if (kv_int(kv, idx, "arch", ARCH_HOPPER) < ARCH_VOLTA) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = may_set(kv, idx);
    if (rc != NVML_SUCCESS) return rc;
    return state_update(idx, "sm_lock", NULL);
}

nvmlReturn_t nvmlDeviceSetMemoryLockedClocks(nvmlDevice_t dev, unsigned lo, unsigned hi) {
    ENTER(dev, "nvmlDeviceSetMemoryLockedClocks");
    if (kv_int(kv, idx, "arch", ARCH_HOPPER) < ARCH_AMPERE) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = may_set(kv, idx);
    if (rc != NVML_SUCCESS) return rc;
    model_t m;
    model_load(kv, idx, &m);
    if (lo > hi || lo < min_mem(&m) || hi > max_mem(&m)) return NVML_ERROR_INVALID_ARGUMENT;
    char v[64];
    snprintf(v, sizeof v, "%u,%u", lo, hi);
    return state_update(idx, "mem_lock", v);
}

nvmlReturn_t nvmlDeviceResetMemoryLockedClocks(nvmlDevice_t dev) {
    ENTER(dev, "nvmlDeviceResetMemoryLockedClocks");
    if (kv_int(kv, idx, "arch", ARCH_HOPPER) < ARCH_AMPERE) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = may_set(kv, idx);
    if (rc != NVML_SUCCESS) return rc;
    return state_update(idx, "mem_lock", NULL);
}

static long long power_limit(const kv_t *kv, int idx) {
    return kv_int(kv, idx, "power_mw", kv_int(kv, idx, "default_power_mw", 700000));
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t dev, unsigned *limit) {
    ENTER(dev, "nvmlDeviceGetPowerManagementLimit");
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned)power_limit(kv, idx);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t dev, unsigned *limit) {
    ENTER(dev, "nvmlDeviceGetEnforcedPowerLimit");
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned)power_limit(kv, idx);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t dev, unsigned *limit) {
    ENTER(dev, "nvmlDeviceGetPowerManagementDefaultLimit");
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned)kv_int(kv, idx, "default_power_mw", 700000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t dev, unsigned *lo,
                                                          unsigned *hi) {
    ENTER(dev, "nvmlDeviceGetPowerManagementLimitConstraints");
    if (!lo || !hi) return NVML_ERROR_INVALID_ARGUMENT;
    *lo = (unsigned)kv_int(kv, idx, "min_power_mw", 200000);
    *hi = (unsigned)kv_int(kv, idx, "max_power_mw", 700000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t dev, unsigned limit) {
    ENTER(dev, "nvmlDeviceSetPowerManagementLimit");
    nvmlReturn_t rc = may_set(kv, idx);
    if (rc != NVML_SUCCESS) return rc;
    long long lo = kv_int(kv, idx, "min_power_mw", 200000);
    long long hi = kv_int(kv, idx, "max_power_mw", 700000);
    if ((long long)limit < lo || (long long)limit > hi) return NVML_ERROR_INVALID_ARGUMENT;
    if ((long long)limit == kv_int(kv, idx, "default_power_mw", 700000))
        return state_update(idx, "power_mw", NULL); /* back to default: as if never set */
    char v[32];
    snprintf(v, sizeof v, "%u", limit);
    return state_update(idx, "power_mw", v);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t dev, unsigned *mw) {
    ENTER(dev, "nvmlDeviceGetPowerUsage");
    if (!mw) return NVML_ERROR_INVALID_ARGUMENT;
    long long draw = kv_int(kv, idx, "power_draw_mw", 350000);
    long long lim = power_limit(kv, idx);
    *mw = (unsigned)(draw < lim ? draw : lim);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, int sensor, unsigned *temp) {
    ENTER(dev, "nvmlDeviceGetTemperature");
    if (!temp || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)kv_int(kv, idx, "temp_c", 45);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *u) {
    ENTER(dev, "nvmlDeviceGetUtilizationRates");
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = (unsigned)kv_int(kv, idx, "util_gpu", 37);
    u->memory = (unsigned)kv_int(kv, idx, "util_mem", 12);
    return NVML_SUCCESS;
}

static void memory_of(const kv_t *kv, int idx, unsigned long long *total,
                      unsigned long long *used) {
    *total = (unsigned long long)kv_int(kv, idx, "mem_total_mib", 81559) << 20;
    *used = (unsigned long long)kv_int(kv, idx, "mem_used_mib", 1024) << 20;
    if (*used > *total) *used = *total;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    ENTER(dev, "nvmlDeviceGetMemoryInfo");
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    memory_of(kv, idx, &mem->total, &mem->used);
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    ENTER(dev, "nvmlDeviceGetMemoryInfo_v2");
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    memory_of(kv, idx, &mem->total, &mem->used);
    mem->reserved = 0;
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

static nvmlReturn_t reasons(nvmlDevice_t dev, const char *fn, unsigned long long *out) {
    ENTER(dev, fn);
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    model_t m;
    model_load(kv, idx, &m);
    unsigned long long r = (unsigned long long)kv_int(kv, idx, "reasons", 0);
    unsigned lo, hi;
    if (kv_pair(kv, idx, "sm_lock", &lo, &hi) || kv_pair(kv, idx, "mem_lock", &lo, &hi))
        r |= REASON_APP_CLOCKS;
    if (kv_int(kv, idx, "power_draw_mw", 350000) > power_limit(kv, idx)) r |= REASON_SW_POWER_CAP;
    if (kv_int(kv, idx, "util_gpu", 37) == 0) r |= REASON_GPU_IDLE;
    *out = r;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *r) {
    return reasons(dev, "nvmlDeviceGetCurrentClocksEventReasons", r);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *r) {
    return reasons(dev, "nvmlDeviceGetCurrentClocksThrottleReasons", r);
}
