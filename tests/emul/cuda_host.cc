/* cuda_host.cc — the CUDA runtime, cuBLAS and cuBLASLt on the host, for the emulated trainer: the
 * CUDA backend's .cu files (kernels/cuda/) are compiled as C++ against the real CUDA headers and
 * linked against this file instead of libcudart, libcublas and libcublasLt, so the whole GPU
 * trainer runs, and is checked, on a CPU in CI. Every function is defined with the prototype
 * its CUDA header declares (a mismatch does not compile), with the C linkage the header gives
 * it; cublas_v2.h's names are the _v2 symbols its macros expand to. cuda_host.h has what the
 * emulated kernel launcher and the tests ask beyond the CUDA API.
 *
 * The machine: DT_EMUL_GPUS GPUs (default 1; 0 is a machine without one), each with
 * DT_EMUL_GPU_MEM bytes (default 8 GiB; a K, M or G suffix multiplies by 2^10, 2^20, 2^30) that
 * cudaMalloc refuses to exceed with cudaErrorMemoryAllocation; DT_EMUL_DRIVER_VERSION (default
 * CUDART_VERSION, 0 for no driver) is what cudaDriverGetVersion says, and a driver of an older
 * major version than the runtime makes every device call fail with cudaErrorInsufficientDriver,
 * as the real runtime does. CUDA_VISIBLE_DEVICES is honoured as the runtime does for GPU
 * numbers: the listed GPUs, in its order, are devices 0, 1, ...; the list ends at its first
 * entry that is not a GPU (out of range, repeated, not a number), and an empty one hides every
 * GPU. A device's PCI address (0000:00:<n>.0) and UUID name its GPU n, whatever its ordinal.
 * The settings are read once, at the first call.
 *
 * Invariants:
 * - Streams are asynchronous, as lazily as CUDA allows: a kernel, copy, memset or cuBLAS /
 *   cuBLASLt product on a stream is checked when called and queued; a stream's queue runs, in
 *   order, only when the host waits for it (cudaStreamSynchronize or Query, cudaEventSynchronize
 *   on an event recorded on it, cudaFree and cudaStreamDestroy, which synchronize) or when
 *   another stream's queued cudaStreamWaitEvent reaches it. So work that the code leaves
 *   unordered runs in the latest order CUDA permits, never by luck in the order it was issued:
 *   a missing event or synchronization between two streams, or a host read of a copy before
 *   the stream's synchronization, gives wrong values here (the tests see them). A host-to-device
 *   copy reads its host memory before it returns (pageable memory: the trainer has no pinned
 *   buffers); a device-to-host one writes it when it runs. Work on the legacy (NULL) stream
 *   runs at once. A gate (dt_emul_enqueue_gate: an emulated NCCL operation running on a thread
 *   of its own) holds its stream's later work until it is passed: host waits then wait,
 *   cudaStreamQuery answers cudaErrorNotReady, as for a GPU kernel that waits for its peers.
 *   Streams and events are handles of their own (small structs in a registry),
 *   so a destroyed or stray one is refused (cudaErrorInvalidResourceHandle) instead of used.
 * - Device memory is host memory, one posix_memalign per cudaMalloc (so ASan sees an overrun
 *   of each allocation), 256-byte aligned like cudaMalloc's, filled with 0xFF bytes (NaN as
 *   fp32 and bf16) because real cudaMalloc does not zero, and poisoned again before it is
 *   freed. A registry maps each start address to its size and GPU.
 * - What a GPU would do silently wrong is refused here, loudly: a copy, memset or GEMM operand
 *   that the call treats as device memory must lie, over its whole extent, inside one live
 *   allocation (host memory must lie outside all of them); a GEMM's arguments are checked as
 *   the reference BLAS checks them; each refusal prints one "cuda_host: <call>: ..." line on
 *   stderr saying what was wrong, and returns the error the real library has for it.
 * - Products accumulate in double (each fp32 x fp32 or bf16 x bf16 product is exact there), in
 *   a fixed order, and are rounded to fp32 once, when stored: results are deterministic. beta 0
 *   never reads C (it may hold NaN); alpha 0 or k 0 never reads A or B.
 * - A failing runtime call returns its error and also makes it the calling thread's last error
 *   (cudaGetLastError returns and clears it, cudaPeekAtLastError only returns it). The current
 *   device is per thread, as in CUDA.
 * - Thread-safe: the trainer's comm thread copies and zeroes device memory while the compute
 *   thread runs, so the registries are under one mutex, and queuing and running work under
 *   another (exec_mu, taken before the registries' where both are held). */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <math.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_host.h"

static_assert(sizeof(__nv_bfloat16) == 2, "bf16 operands are read as 16-bit patterns");

/* ------------------------------------------------------------------------------------------ */
/* The emulated machine                                                                        */
/* ------------------------------------------------------------------------------------------ */

#define MAX_GPUS         64
#define SMEM_DEFAULT     (48 * 1024)  /* dynamic shared memory without opting in */
#define SMEM_OPTIN       (227 * 1024) /* an H100's sharedMemPerBlockOptin */
#define SMEM_PER_SM      (228 * 1024)
#define DEFAULT_GPU_MEM  (8ull << 30)
#define MALLOC_ALIGNMENT 256 /* cudaMalloc's */

typedef struct {
  int gpus;               /* visible ones */
  int gpu[MAX_GPUS];      /* (gpus) device i is the machine's GPU gpu[i] (CUDA_VISIBLE_DEVICES) */
  unsigned long long mem; /* bytes per GPU */
  int driver;             /* cudaDriverGetVersion's; 0: no driver */
} config_t;

/* A non-negative integer from the environment, with an optional binary K/M/G suffix where
 * suffix is set; def when unset. A malformed value aborts: a test that sets one means it. */
static unsigned long long env_number(const char *name, unsigned long long def,
                                     unsigned long long max, bool suffix)
{
  const char *s = getenv(name);
  if (!s || !*s)
    return def;
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  unsigned shift = 0;
  if (suffix && end && *end) {
    shift = *end == 'K' || *end == 'k'   ? 10
            : *end == 'M' || *end == 'm' ? 20
            : *end == 'G' || *end == 'g' ? 30
                                         : 0;
    end += shift ? 1 : 0;
  }
  if (end == s || *end || s[0] == '-' || (shift && v > (max >> shift)) || (v << shift) > max) {
    fprintf(stderr, "cuda_host: %s=\"%s\" is not a number from 0 to %llu%s\n", name, s, max,
            suffix ? " (optionally with a K, M or G suffix)" : "");
    abort();
  }
  return v << shift;
}

/* CUDA_VISIBLE_DEVICES over a machine of n GPUs (the module comment). */
static int visible_gpus(int n, int *gpu)
{
  const char *s = getenv("CUDA_VISIBLE_DEVICES");
  if (!s) {
    for (int i = 0; i < n; i++)
      gpu[i] = i;
    return n;
  }
  int count = 0;
  bool seen[MAX_GPUS] = {false};
  while (*s && count < n) {
    char *end = NULL;
    const long v = strtol(s, &end, 10);
    if (end == s || (*end && *end != ',') || v < 0 || v >= n || seen[v])
      break;
    seen[v] = true;
    gpu[count++] = (int)v;
    s = *end ? end + 1 : end;
  }
  return count;
}

static config_t read_config(void)
{
  config_t c;
  c.gpus = visible_gpus((int)env_number("DT_EMUL_GPUS", 1, MAX_GPUS, false), c.gpu);
  c.mem = env_number("DT_EMUL_GPU_MEM", DEFAULT_GPU_MEM, 1ull << 50, true);
  c.driver = (int)env_number("DT_EMUL_DRIVER_VERSION", CUDART_VERSION, 1000000, false);
  return c;
}

static const config_t &cfg(void)
{
  static const config_t c = read_config(); /* thread-safe initialisation */
  return c;
}

/* What every call that needs a GPU checks first: a usable driver (none, or one of an older
 * major version than the runtime, is cudaErrorInsufficientDriver: minor version compatibility
 * lets a same-major driver run a newer minor runtime), then at least one GPU. */
static cudaError_t gate(void)
{
  const config_t &c = cfg();
  if (c.driver == 0 || c.driver / 1000 < CUDART_VERSION / 1000)
    return cudaErrorInsufficientDriver;
  return c.gpus == 0 ? cudaErrorNoDevice : cudaSuccess;
}

static bool valid_device(int device)
{
  return device >= 0 && device < cfg().gpus;
}

/* ------------------------------------------------------------------------------------------ */
/* Per-thread state and the registries                                                         */
/* ------------------------------------------------------------------------------------------ */

static thread_local cudaError_t t_last_error = cudaSuccess;
static thread_local int t_device = 0;

/* A failing runtime call's return: the error, also left as the thread's last error. */
static cudaError_t fail(cudaError_t e)
{
  t_last_error = e;
  return e;
}

#define GATE()                                                                                     \
  do {                                                                                             \
    const cudaError_t gate_e = gate();                                                             \
    if (gate_e != cudaSuccess)                                                                     \
      return fail(gate_e);                                                                         \
  } while (0)

typedef struct {
  size_t bytes;
  int device;
} alloc_t;

typedef std::map<uintptr_t, alloc_t> alloc_map_t;

typedef enum { K_STREAM, K_EVENT, K_BLAS, K_LT, K_LT_DESC, K_LT_LAYOUT, K_LT_PREF } kind_t;

typedef struct registry {
  std::mutex mu;
  alloc_map_t allocs;                               /* start address -> size and GPU */
  size_t live[MAX_GPUS] = {};                       /* allocated bytes per GPU */
  std::unordered_map<const void *, kind_t> handles; /* every live handle, by kind */
  std::unordered_map<const void *, int> smem;       /* kernel -> its dynamic shared memory limit */
  std::map<uintptr_t, size_t> pinned;               /* cudaMallocHost's: start -> bytes */
} registry_t;

/* Never destroyed: the comm thread may still copy while the process exits. */
static registry_t &reg(void)
{
  static registry_t *r = new registry_t();
  return *r;
}

static std::atomic<int> g_tf32_seen(0);

/* The allocation holding address p, or NULL (caller holds the lock). */
static const alloc_map_t::value_type *containing(uintptr_t p)
{
  alloc_map_t &m = reg().allocs;
  alloc_map_t::iterator it = m.upper_bound(p);
  if (it == m.begin())
    return NULL;
  --it;
  return p - it->first < it->second.bytes ? &*it : NULL;
}

/* An allocation sharing a byte with [p, p + n), n >= 1, or NULL (caller holds the lock).
 * Allocations are disjoint, so only the last one starting before p + n can. */
static const alloc_map_t::value_type *overlapping(uintptr_t p, uint64_t n)
{
  alloc_map_t &m = reg().allocs;
  alloc_map_t::iterator it = m.lower_bound(p + n);
  if (it == m.begin())
    return NULL;
  --it;
  return it->first + it->second.bytes > p ? &*it : NULL;
}

static bool live_handle(const void *h, kind_t kind)
{
  if (!h)
    return false;
  std::lock_guard<std::mutex> lock(reg().mu);
  std::unordered_map<const void *, kind_t>::const_iterator it = reg().handles.find(h);
  return it != reg().handles.end() && it->second == kind;
}

static void add_handle(const void *h, kind_t kind)
{
  std::lock_guard<std::mutex> lock(reg().mu);
  reg().handles[h] = kind;
}

/* Removes a live handle of that kind; false if h is none. */
static bool remove_handle(const void *h, kind_t kind)
{
  if (!h)
    return false;
  std::lock_guard<std::mutex> lock(reg().mu);
  std::unordered_map<const void *, kind_t>::iterator it = reg().handles.find(h);
  if (it == reg().handles.end() || it->second != kind)
    return false;
  reg().handles.erase(it);
  return true;
}

/* ------------------------------------------------------------------------------------------ */
/* Reports and range checks                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* One line on stderr: what a call was refused for. */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...)
{
  char line[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cuda_host: %s\n", line);
}

/* Why [p, p + n) is not inside one allocation, in words (caller holds the lock). */
static void describe(uintptr_t p, uint64_t n, char *buf, size_t len)
{
  const alloc_map_t::value_type *a = containing(p);
  if (a && p + n - a->first <= a->second.bytes)
    snprintf(buf, len, "it lies %llu bytes into the %zu-byte allocation at %#llx",
             (unsigned long long)(p - a->first), a->second.bytes, (unsigned long long)a->first);
  else if (a)
    snprintf(buf, len,
             "it starts %llu bytes into the %zu-byte allocation at %#llx and runs %llu bytes past "
             "its end",
             (unsigned long long)(p - a->first), a->second.bytes, (unsigned long long)a->first,
             (unsigned long long)(p + n - (a->first + a->second.bytes)));
  else if ((a = overlapping(p, n)))
    snprintf(buf, len,
             "it starts outside device memory and overlaps the %zu-byte allocation at %#llx",
             a->second.bytes, (unsigned long long)a->first);
  else
    snprintf(buf, len,
             "no live allocation holds it (host memory, freed memory or a stray pointer)");
}

/* Whether [p, p + n), n >= 1, lies inside one live allocation, of GPU `device` unless that is
 * -1; if not, reports "<fn>: <what> ..." and returns false. */
static bool device_range(const char *fn, const char *what, const void *p, uint64_t n, int device)
{
  const uintptr_t u = (uintptr_t)p;
  char why[256];
  if (!p) {
    report("%s: %s is NULL, not device memory", fn, what);
    return false;
  }
  if (n > UINTPTR_MAX - u) {
    report("%s: %s (%llu bytes at %p) wraps around the address space", fn, what,
           (unsigned long long)n, p);
    return false;
  }
  std::lock_guard<std::mutex> lock(reg().mu);
  const alloc_map_t::value_type *a = containing(u);
  if (a && u + n - a->first <= a->second.bytes) {
    if (device < 0 || a->second.device == device)
      return true;
    report("%s: %s (%llu bytes at %p) is GPU %d's memory, but the call runs on GPU %d", fn, what,
           (unsigned long long)n, p, a->second.device, device);
    return false;
  }
  describe(u, n, why, sizeof why);
  report("%s: %s (%llu bytes at %p) is not inside one live device allocation: %s", fn, what,
         (unsigned long long)n, p, why);
  return false;
}

/* Whether [p, p + n), n >= 1, is host memory: not NULL and sharing no byte with a live
 * allocation; if not, reports it. */
static bool host_range(const char *fn, const char *what, const void *p, uint64_t n)
{
  const uintptr_t u = (uintptr_t)p;
  if (!p) {
    report("%s: %s is NULL", fn, what);
    return false;
  }
  if (n > UINTPTR_MAX - u) {
    report("%s: %s (%llu bytes at %p) wraps around the address space", fn, what,
           (unsigned long long)n, p);
    return false;
  }
  std::lock_guard<std::mutex> lock(reg().mu);
  const alloc_map_t::value_type *a = overlapping(u, n);
  if (!a)
    return true;
  report("%s: %s (%llu bytes at %p) should be host memory, but it overlaps the %zu-byte device "
         "allocation at %#llx",
         fn, what, (unsigned long long)n, p, a->second.bytes, (unsigned long long)a->first);
  return false;
}

/* cudaMemcpyDefault's rule: either side may be either, but a range that touches device memory
 * must lie inside one allocation. */
static bool any_range(const char *fn, const char *what, const void *p, uint64_t n)
{
  const uintptr_t u = (uintptr_t)p;
  if (!p || n > UINTPTR_MAX - u)
    return host_range(fn, what, p, n); /* reports it */
  bool device;
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    device = overlapping(u, n) != NULL;
  }
  return device ? device_range(fn, what, p, n, -1) : true;
}

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* The runtime's names and messages for the errors this file returns and a launcher sets. */
#define DT_EMUL_ERRORS(X)                                                                          \
  X(cudaSuccess, "no error")                                                                       \
  X(cudaErrorInvalidValue, "invalid argument")                                                     \
  X(cudaErrorMemoryAllocation, "out of memory")                                                    \
  X(cudaErrorInitializationError, "initialization error")                                          \
  X(cudaErrorCudartUnloading, "driver shutting down")                                              \
  X(cudaErrorInvalidConfiguration, "invalid configuration argument")                               \
  X(cudaErrorInvalidPitchValue, "invalid pitch argument")                                          \
  X(cudaErrorInvalidSymbol, "invalid device symbol")                                               \
  X(cudaErrorInvalidHostPointer, "invalid host pointer")                                           \
  X(cudaErrorInvalidDevicePointer, "invalid device pointer")                                       \
  X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                          \
  X(cudaErrorStubLibrary, "CUDA driver is a stub library")                                         \
  X(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version")   \
  X(cudaErrorCallRequiresNewerDriver, "API call is not supported in the installed CUDA driver")    \
  X(cudaErrorMissingConfiguration, "__global__ function call is not configured")                   \
  X(cudaErrorInvalidDeviceFunction, "invalid device function")                                     \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                       \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                                              \
  X(cudaErrorStartupFailure, "device kernel image is invalid")                                     \
  X(cudaErrorInvalidKernelImage, "device kernel image is invalid")                                 \
  X(cudaErrorNoKernelImageForDevice, "no kernel image is available for execution on the device")   \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                     \
  X(cudaErrorNotReady, "device not ready")                                                         \
  X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                           \
  X(cudaErrorLaunchOutOfResources, "too many resources requested for launch")                      \
  X(cudaErrorLaunchTimeout, "the launch timed out and was terminated")                             \
  X(cudaErrorAssert, "device-side assert triggered")                                               \
  X(cudaErrorIllegalInstruction, "an illegal instruction was encountered")                         \
  X(cudaErrorMisalignedAddress, "misaligned address")                                              \
  X(cudaErrorLaunchFailure, "unspecified launch failure")                                          \
  X(cudaErrorCooperativeLaunchTooLarge, "too many blocks in cooperative launch")                   \
  X(cudaErrorNotPermitted, "operation not permitted")                                              \
  X(cudaErrorNotSupported, "operation not supported")                                              \
  X(cudaErrorSystemDriverMismatch,                                                                 \
    "system has unsupported display driver / cuda driver combination")                             \
  X(cudaErrorInvalidClusterSize, "invalid cluster size")                                           \
  X(cudaErrorUnknown, "unknown error")

extern "C" {

const char *cudaGetErrorName(cudaError_t error)
{
#define X(e, msg)                                                                                  \
  case e:                                                                                          \
    return #e;
  switch (error) {
    DT_EMUL_ERRORS(X)
  default:
    return "unrecognized error code"; /* as CUDA's documentation says */
  }
#undef X
}

const char *cudaGetErrorString(cudaError_t error)
{
#define X(e, msg)                                                                                  \
  case e:                                                                                          \
    return msg;
  switch (error) {
    DT_EMUL_ERRORS(X)
  default:
    return "unrecognized error code";
  }
#undef X
}

cudaError_t cudaGetLastError(void)
{
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void)
{
  return t_last_error;
}

/* ------------------------------------------------------------------------------------------ */
/* Devices                                                                                     */
/* ------------------------------------------------------------------------------------------ */

cudaError_t cudaDriverGetVersion(int *driverVersion)
{
  if (!driverVersion)
    return fail(cudaErrorInvalidValue);
  *driverVersion = cfg().driver;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion)
{
  if (!runtimeVersion)
    return fail(cudaErrorInvalidValue);
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *count)
{
  if (!count)
    return fail(cudaErrorInvalidValue);
  *count = 0;
  GATE();
  *count = cfg().gpus;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
  GATE();
  if (!valid_device(device))
    return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
  if (!device)
    return fail(cudaErrorInvalidValue);
  GATE();
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
  if (!prop)
    return fail(cudaErrorInvalidValue);
  GATE();
  if (!valid_device(device))
    return fail(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "distrain emulated GPU");
  for (int i = 0; i < 16; i++) /* a stable, distinct UUID per ordinal */
    prop->uuid.bytes[i] = (char)(i == 15 ? cfg().gpu[device] : 0xd7);
  prop->totalGlobalMem = (size_t)cfg().mem;
  prop->sharedMemPerBlock = SMEM_DEFAULT;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->memPitch = 2147483647;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->textureAlignment = 512;
  prop->texturePitchAlignment = 32;
  prop->multiProcessorCount = 132;
  prop->canMapHostMemory = 1;
  prop->concurrentKernels = 1;
  prop->ECCEnabled = 1;
  prop->pciDomainID = 0;
  prop->pciBusID = 0;
  prop->pciDeviceID = cfg().gpu[device]; /* cudaDeviceGetPCIBusId's "0000:00:<gpu>.0" */
  prop->asyncEngineCount = 3;
  prop->unifiedAddressing = 1;
  prop->memoryBusWidth = 5120;
  prop->l2CacheSize = 50 << 20;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->streamPrioritiesSupported = 1;
  prop->globalL1CacheSupported = 1;
  prop->localL1CacheSupported = 1;
  prop->sharedMemPerMultiprocessor = SMEM_PER_SM;
  prop->regsPerMultiprocessor = 65536;
  prop->managedMemory = 1;
  prop->computePreemptionSupported = 1;
  prop->cooperativeLaunch = 1;
  prop->sharedMemPerBlockOptin = SMEM_OPTIN;
  prop->maxBlocksPerMultiProcessor = 32;
  prop->reservedSharedMemPerBlock = 1024;
  prop->memoryPoolsSupported = 1;
  prop->clusterLaunch = 1;
  prop->deviceNumaId = -1;
  prop->hostNumaId = -1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
  if (!value)
    return fail(cudaErrorInvalidValue);
  GATE();
  if (!valid_device(device))
    return fail(cudaErrorInvalidDevice);
  switch (attr) { /* the values cudaGetDeviceProperties gives */
  case cudaDevAttrComputeCapabilityMajor:
    *value = 9;
    return cudaSuccess;
  case cudaDevAttrComputeCapabilityMinor:
    *value = 0;
    return cudaSuccess;
  case cudaDevAttrMultiProcessorCount:
    *value = 132;
    return cudaSuccess;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin:
    *value = SMEM_OPTIN;
    return cudaSuccess;
  case cudaDevAttrMaxSharedMemoryPerBlock:
    *value = SMEM_DEFAULT;
    return cudaSuccess;
  case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
    *value = SMEM_PER_SM;
    return cudaSuccess;
  case cudaDevAttrMaxThreadsPerBlock:
  case cudaDevAttrMaxBlockDimX:
  case cudaDevAttrMaxBlockDimY:
    *value = 1024;
    return cudaSuccess;
  case cudaDevAttrMaxBlockDimZ:
    *value = 64;
    return cudaSuccess;
  case cudaDevAttrMaxGridDimX:
    *value = 2147483647;
    return cudaSuccess;
  case cudaDevAttrMaxGridDimY:
  case cudaDevAttrMaxGridDimZ:
    *value = 65535;
    return cudaSuccess;
  case cudaDevAttrWarpSize:
    *value = 32;
    return cudaSuccess;
  case cudaDevAttrMaxThreadsPerMultiProcessor:
    *value = 2048;
    return cudaSuccess;
  case cudaDevAttrPciDomainId:
  case cudaDevAttrPciBusId:
    *value = 0;
    return cudaSuccess;
  case cudaDevAttrPciDeviceId:
    *value = device;
    return cudaSuccess;
  default:
    report("cudaDeviceGetAttribute: attribute %d is not emulated", (int)attr);
    return fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device)
{
  char id[32];
  if (!pciBusId || len <= 0)
    return fail(cudaErrorInvalidValue);
  GATE();
  if (!valid_device(device))
    return fail(cudaErrorInvalidDevice);
  const int n = snprintf(id, sizeof id, "%04X:%02X:%02X.0", 0, 0, cfg().gpu[device]);
  if (n >= len) /* a truncated address would name another GPU */
    return fail(cudaErrorInvalidValue);
  memcpy(pciBusId, id, (size_t)n + 1);
  return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                      */
/* ------------------------------------------------------------------------------------------ */

cudaError_t cudaMalloc(void **devPtr, size_t size)
{
  if (!devPtr)
    return fail(cudaErrorInvalidValue);
  *devPtr = NULL;
  GATE();
  if (size == 0) /* as CUDA: success, and no allocation */
    return cudaSuccess;
  const int dev = t_device;
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    if (size > cfg().mem - reg().live[dev])
      return fail(cudaErrorMemoryAllocation);
    reg().live[dev] += size; /* reserved before the lock is let go */
  }
  void *p = NULL;
  if (posix_memalign(&p, MALLOC_ALIGNMENT, size) != 0) {
    std::lock_guard<std::mutex> lock(reg().mu);
    reg().live[dev] -= size;
    return fail(cudaErrorMemoryAllocation);
  }
  memset(p, 0xFF, size);
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    alloc_t a = {size, dev};
    reg().allocs[(uintptr_t)p] = a;
  }
  *devPtr = p;
  return cudaSuccess;
}

static void drain_all(void); /* with the streams, below */

/* [p, p + n) lies in one block of cudaMallocHost's. */
static bool pinned(uintptr_t p, size_t n)
{
  std::lock_guard<std::mutex> lock(reg().mu);
  std::map<uintptr_t, size_t>::iterator it = reg().pinned.upper_bound(p);
  if (it == reg().pinned.begin())
    return false;
  --it;
  return p - it->first < it->second && n <= it->second - (p - it->first);
}

/* Page-locked host memory: host memory, which the copies read and write when they run. */
cudaError_t cudaMallocHost(void **ptr, size_t size)
{
  if (!ptr)
    return fail(cudaErrorInvalidValue);
  *ptr = NULL;
  GATE();
  void *p = malloc(size ? size : 1);
  if (!p)
    return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(reg().mu);
  reg().pinned[(uintptr_t)p] = size ? size : 1;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *ptr)
{
  if (!ptr)
    return cudaSuccess;
  drain_all(); /* as cudaFree: queued copies may still read it */
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    if (reg().pinned.erase((uintptr_t)ptr) == 0) {
      report("cudaFreeHost: %p is not the start of a cudaMallocHost block", ptr);
      return fail(cudaErrorInvalidValue);
    }
  }
  free(ptr);
  return cudaSuccess;
}

/* Frees a live allocation (fn's: a report names it otherwise), or with check_only only checks
 * that devPtr is one. */
static cudaError_t release(const char *fn, void *devPtr, bool check_only)
{
  size_t bytes;
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    alloc_map_t::iterator it = reg().allocs.find((uintptr_t)devPtr);
    if (it == reg().allocs.end()) {
      char why[256];
      describe((uintptr_t)devPtr, 1, why, sizeof why);
      report("%s: %p is not the start of a live allocation: %s", fn, devPtr, why);
      return fail(cudaErrorInvalidValue);
    }
    if (check_only)
      return cudaSuccess;
    bytes = it->second.bytes;
    reg().live[it->second.device] -= bytes;
    reg().allocs.erase(it);
  }
  memset(devPtr, 0xFF, bytes); /* a stale read sees NaN even where malloc reuses the memory */
  free(devPtr);
  return cudaSuccess;
}

cudaError_t cudaFree(void *devPtr)
{
  if (!devPtr)
    return cudaSuccess;
  drain_all(); /* cudaFree synchronizes the device: queued work may still use the memory */
  return release("cudaFree", devPtr, false);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
  if (!free_bytes || !total)
    return fail(cudaErrorInvalidValue);
  GATE();
  std::lock_guard<std::mutex> lock(reg().mu);
  *total = (size_t)cfg().mem;
  *free_bytes = (size_t)(cfg().mem - reg().live[t_device]);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr)
{
  if (!attributes)
    return fail(cudaErrorInvalidValue);
  memset(attributes, 0, sizeof *attributes);
  std::lock_guard<std::mutex> lock(reg().mu);
  const alloc_map_t::value_type *a = ptr ? containing((uintptr_t)ptr) : NULL;
  if (a) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = a->second.device;
    attributes->devicePointer = (void *)ptr;
  } else { /* what CUDA says of memory it does not know (not an error since CUDA 11) */
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
    attributes->hostPointer = (void *)ptr;
  }
  return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                          */
/* ------------------------------------------------------------------------------------------ */

} /* extern "C" */

/* The handles' own structs (the headers leave them incomplete). A stream holds the work queued
 * on it and not yet run; an event, the stream and the queue position it was last recorded at. */
struct CUstream_st {
  int device;
  unsigned flags;
  /* An item runs its work and returns true, or returns false while it cannot be passed yet (a
   * gate: dt_emul_enqueue_gate, or a wait for another stream stopped at one): it stays first and
   * is asked again on the next drain, so it must be safe to repeat. */
  std::deque<std::function<bool()>> work;
  uint64_t queued, done; /* items ever queued on it / run */
};

struct CUevent_st {
  int device;
  unsigned flags;
  CUstream_st *stream; /* NULL: never recorded, or on the legacy stream (complete) */
  uint64_t mark;       /* complete once stream->done reaches it */
  bool recorded;
  /* A timing event's (no cudaEventDisableTiming) host clock, in ms, when its stream's work
   * reached it: set by a queued item of its own, which holds the pointer it writes, so that an
   * event destroyed or recorded again before that item ran is not written. */
  std::shared_ptr<double> at;
};

/* Held while any queued work is queued or runs (one kernel at a time, cuda_emul.h's model);
 * recursive: running a stream's work can drain another (cudaStreamWaitEvent). */
static std::recursive_mutex &exec_mu(void)
{
  static std::recursive_mutex *m = new std::recursive_mutex(); /* never destroyed */
  return *m;
}

/* A stream with a queue of its own: not NULL, the legacy or the per-thread stream (whose work
 * runs at once: the backend never uses them). */
static bool queues(cudaStream_t s)
{
  return s && s != cudaStreamLegacy && s != cudaStreamPerThread;
}

/* Queues item on stream s (checked by the caller); where s does not queue, runs it now (it must
 * not be a gate there). */
static void enqueue_item(cudaStream_t s, std::function<bool()> item)
{
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  if (!queues(s)) {
    (void)item();
    return;
  }
  s->work.push_back(std::move(item));
  s->queued++;
}

/* Queues f on stream s (checked by the caller), or runs it now where s does not queue. */
static void enqueue(cudaStream_t s, std::function<void()> f)
{
  enqueue_item(s, [f = std::move(f)] {
    f();
    return true;
  });
}

/* Runs s's queued work in order until `upto` items of it have run: true, or false where an item
 * cannot be passed yet (it stays queued). The item is off the queue while it runs, so that the
 * stream waits it starts see the rest. */
static bool drain(cudaStream_t s, uint64_t upto)
{
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  while (queues(s) && s->done < upto && !s->work.empty()) {
    std::function<bool()> f = std::move(s->work.front());
    s->work.pop_front();
    s->done++;
    if (!f()) {
      s->done--;
      s->work.push_front(std::move(f));
      return false;
    }
  }
  return true;
}

/* A host wait: tries until try_once() is true, letting the other threads queue and run work in
 * between (an item that cannot be passed waits for something outside the streams). */
static void wait_for(const std::function<bool()> &try_once)
{
  while (!try_once())
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

/* NULL and the two special streams always exist; others must be live. */
static bool stream_ok(cudaStream_t s)
{
  return !s || s == cudaStreamLegacy || s == cudaStreamPerThread || live_handle(s, K_STREAM);
}

/* Runs every stream's queued work (what a device-wide synchronization waits for). */
static void drain_all(void)
{
  wait_for([] {
    std::lock_guard<std::recursive_mutex> lock(exec_mu());
    std::vector<cudaStream_t> streams;
    {
      std::lock_guard<std::mutex> rlock(reg().mu);
      for (const auto &h : reg().handles)
        if (h.second == K_STREAM)
          streams.push_back((cudaStream_t)h.first);
    }
    bool all = true;
    for (cudaStream_t s : streams)
      all = drain(s, s->queued) && all;
    return all;
  });
}

static cudaError_t check_stream(const char *fn, cudaStream_t s)
{
  if (stream_ok(s))
    return cudaSuccess;
  report("%s: stream %p is not a live stream (destroyed, or never created)", fn, (void *)s);
  return fail(cudaErrorInvalidResourceHandle);
}

/* Stream-ordered allocation, as the stream's pool does it: cudaMallocAsync's memory is allocated
 * at once (work queued before it cannot see its address), cudaFreeAsync frees it when the
 * stream's work reaches the free, without synchronizing anything. */
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream)
{
  if (check_stream("cudaMallocAsync", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  return cudaMalloc(devPtr, size);
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream)
{
  if (!devPtr)
    return cudaSuccess;
  if (check_stream("cudaFreeAsync", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  const cudaError_t e = release("cudaFreeAsync", devPtr, true);
  if (e != cudaSuccess)
    return e;
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  enqueue(stream, [devPtr] { (void)release("cudaFreeAsync", devPtr, false); });
  return cudaSuccess;
}

/* The shared checks of a copy of dn bytes to dst and sn bytes from src (a 2D copy's spans). */
static cudaError_t copy_check(const char *fn, const void *dst, uint64_t dn, const void *src,
                              uint64_t sn, cudaMemcpyKind kind, cudaStream_t stream)
{
  bool ok;
  if (check_stream(fn, stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  switch (kind) {
  case cudaMemcpyHostToHost:
    ok = host_range(fn, "the destination", dst, dn) && host_range(fn, "the source", src, sn);
    break;
  case cudaMemcpyHostToDevice:
    ok = device_range(fn, "the destination", dst, dn, -1) && host_range(fn, "the source", src, sn);
    break;
  case cudaMemcpyDeviceToHost:
    ok = host_range(fn, "the destination", dst, dn) && device_range(fn, "the source", src, sn, -1);
    break;
  case cudaMemcpyDeviceToDevice:
    ok = device_range(fn, "the destination", dst, dn, -1) &&
         device_range(fn, "the source", src, sn, -1);
    break;
  case cudaMemcpyDefault:
    ok = any_range(fn, "the destination", dst, dn) && any_range(fn, "the source", src, sn);
    break;
  default:
    report("%s: copy kind %d is not a cudaMemcpyKind", fn, (int)kind);
    return fail(cudaErrorInvalidMemcpyDirection);
  }
  return ok ? cudaSuccess : fail(cudaErrorInvalidValue);
}

extern "C" {

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
  if (count == 0)
    return check_stream("cudaMemcpyAsync", stream);
  const cudaError_t e = copy_check("cudaMemcpyAsync", dst, count, src, count, kind, stream);
  if (e != cudaSuccess)
    return e;
  const uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (d != s && d < s + count && s < d + count) { /* undefined on a GPU */
    report("cudaMemcpyAsync: the source and destination (%zu bytes at %p and %p) overlap", count,
           src, dst);
    return fail(cudaErrorInvalidValue);
  }
  if (kind == cudaMemcpyHostToDevice && !pinned(s, count)) {
    /* pageable host memory: read before the call returns; pinned memory is read when the copy
     * runs, as a GPU's DMA reads it, so that a host that rewrites it too early is caught */
    std::vector<char> staged((const char *)src, (const char *)src + count);
    enqueue(stream,
            [dst, staged = std::move(staged)] { memcpy(dst, staged.data(), staged.size()); });
  } else {
    enqueue(stream, [dst, src, count] { memmove(dst, src, count); });
  }
  return cudaSuccess;
}

/* The synchronous forms, for the tests (the backend copies on its stream). */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
  return cudaMemcpyAsync(dst, src, count, kind, 0);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, enum cudaMemcpyKind kind,
                              cudaStream_t stream)
{
  const char *fn = "cudaMemcpy2DAsync";
  if (width == 0 || height == 0)
    return check_stream(fn, stream);
  if (width > dpitch || width > spitch) {
    report("%s: width %zu is wider than the pitch (destination %zu, source %zu)", fn, width, dpitch,
           spitch);
    return fail(cudaErrorInvalidPitchValue);
  }
  uint64_t dn, sn; /* each side's span: (height - 1) pitches and one row */
  if (__builtin_mul_overflow((uint64_t)(height - 1), (uint64_t)dpitch, &dn) ||
      __builtin_mul_overflow((uint64_t)(height - 1), (uint64_t)spitch, &sn) ||
      __builtin_add_overflow(dn, (uint64_t)width, &dn) ||
      __builtin_add_overflow(sn, (uint64_t)width, &sn)) {
    report("%s: %zu rows of pitch %zu / %zu overflow", fn, height, dpitch, spitch);
    return fail(cudaErrorInvalidValue);
  }
  const cudaError_t e = copy_check(fn, dst, dn, src, sn, kind, stream);
  if (e != cudaSuccess)
    return e;
  std::vector<char> staged; /* pageable host memory: read before the call returns */
  if (kind == cudaMemcpyHostToDevice) {
    staged.assign((const char *)src, (const char *)src + sn);
    src = NULL;
  }
  enqueue(stream, [=, staged = std::move(staged)] {
    const char *from = src ? (const char *)src : staged.data();
    for (size_t r = 0; r < height; r++)
      memmove((char *)dst + r * dpitch, from + r * spitch, width);
  });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream)
{
  const char *fn = "cudaMemsetAsync";
  if (check_stream(fn, stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  if (count == 0)
    return cudaSuccess;
  if (!device_range(fn, "the memory", devPtr, count, -1))
    return fail(cudaErrorInvalidValue);
  enqueue(stream, [devPtr, value, count] { memset(devPtr, (unsigned char)value, count); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void *devPtr, int value, size_t count)
{
  return cudaMemsetAsync(devPtr, value, count, 0);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags)
{
  if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking))
    return fail(cudaErrorInvalidValue);
  GATE();
  CUstream_st *s = new (std::nothrow) CUstream_st;
  if (!s)
    return fail(cudaErrorMemoryAllocation);
  s->device = t_device;
  s->flags = flags;
  s->queued = s->done = 0;
  add_handle(s, K_STREAM);
  *pStream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
  if (live_handle(stream, K_STREAM)) /* its queued work still runs, as CUDA's does */
    wait_for([stream] { return drain(stream, stream->queued); });
  if (!remove_handle(stream, K_STREAM)) {
    report("cudaStreamDestroy: %p is not a live stream", (void *)stream);
    return fail(cudaErrorInvalidResourceHandle);
  }
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
  if (check_stream("cudaStreamSynchronize", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  wait_for([stream] { return drain(stream, queues(stream) ? stream->queued : 0); });
  return cudaSuccess;
}

/* Runs the stream's work and answers cudaSuccess, or cudaErrorNotReady where a gate holds it: a
 * caller polling until the work is done would otherwise wait for ever (nothing runs the
 * kernels in the background). */
cudaError_t cudaStreamQuery(cudaStream_t stream)
{
  if (check_stream("cudaStreamQuery", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  return drain(stream, queues(stream) ? stream->queued : 0) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (!event || (flags & ~known) ||
      ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
    return fail(cudaErrorInvalidValue);
  GATE();
  CUevent_st *e = new (std::nothrow) CUevent_st;
  if (!e)
    return fail(cudaErrorMemoryAllocation);
  e->device = t_device;
  e->flags = flags;
  e->stream = NULL;
  e->mark = 0;
  e->recorded = false;
  add_handle(e, K_EVENT);
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
  if (!live_handle(event, K_EVENT)) {
    report("cudaEventRecord: %p is not a live event", (void *)event);
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (check_stream("cudaEventRecord", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  const int sdev = live_handle(stream, K_STREAM) ? stream->device : t_device;
  if (sdev != event->device) { /* CUDA refuses an event and a stream of different GPUs */
    report("cudaEventRecord: the event is GPU %d's, the stream GPU %d's", event->device, sdev);
    return fail(cudaErrorInvalidResourceHandle);
  }
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  if (!(event->flags & cudaEventDisableTiming)) {
    std::shared_ptr<double> at = std::make_shared<double>(NAN);
    event->at = at;
    enqueue(stream, [at] {
      *at = std::chrono::duration<double, std::milli>(
                std::chrono::steady_clock::now().time_since_epoch())
                .count();
    });
  }
  event->stream = queues(stream) ? stream : NULL;
  event->mark = queues(stream) ? stream->queued : 0;
  event->recorded = true;
  return cudaSuccess;
}

static bool event_done(cudaEvent_t e)
{
  return !e->stream || !live_handle(e->stream, K_STREAM) || e->stream->done >= e->mark;
}

/* As CUDA: both events recorded, with timing, and complete (cudaErrorNotReady otherwise:
 * here work runs only when the host waits for it, so a missing wait always shows). */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
  if (!ms)
    return fail(cudaErrorInvalidValue);
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  for (cudaEvent_t e : {start, end})
    if (!live_handle(e, K_EVENT) || !e->recorded || (e->flags & cudaEventDisableTiming)) {
      report("cudaEventElapsedTime: %p is not a live, recorded event with timing", (void *)e);
      return fail(cudaErrorInvalidResourceHandle);
    }
  if (!event_done(start) || !event_done(end))
    return cudaErrorNotReady; /* not an error CUDA keeps as the last one */
  *ms = (float)(*end->at - *start->at);
  return cudaSuccess;
}

/* Runs the work an event waits for (its stream's, up to where it was recorded): true once it
 * has run. */
static bool drain_to(cudaStream_t s, uint64_t mark)
{
  return !s || !live_handle(s, K_STREAM) || drain(s, mark);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
  if (!live_handle(event, K_EVENT)) {
    report("cudaEventSynchronize: %p is not a live event", (void *)event);
    return fail(cudaErrorInvalidResourceHandle);
  }
  cudaStream_t s;
  uint64_t mark;
  {
    std::lock_guard<std::recursive_mutex> lock(exec_mu());
    s = event->stream;
    mark = event->mark;
  }
  wait_for([s, mark] { return drain_to(s, mark); });
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event)
{
  if (!remove_handle(event, K_EVENT)) {
    report("cudaEventDestroy: %p is not a live event", (void *)event);
    return fail(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
  if (check_stream("cudaStreamWaitEvent", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  if (!live_handle(event, K_EVENT)) {
    report("cudaStreamWaitEvent: %p is not a live event", (void *)event);
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (flags & ~(unsigned)cudaEventWaitExternal)
    return fail(cudaErrorInvalidValue);
  std::lock_guard<std::recursive_mutex> lock(exec_mu());
  cudaStream_t s = event->stream;
  const uint64_t mark = event->mark;
  enqueue_item(stream, [s, mark] { return drain_to(s, mark); }); /* the event's work first */
  return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* Kernels' attributes                                                                         */
/* ------------------------------------------------------------------------------------------ */

cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value)
{
  GATE();
  if (!func)
    return fail(cudaErrorInvalidDeviceFunction);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return cudaSuccess; /* carveouts, cluster shapes: no effect on the host */
  if (value < 0 || value > SMEM_OPTIN) {
    report("cudaFuncSetAttribute: %d bytes of dynamic shared memory asked, the GPU opts in to at "
           "most %d",
           value, SMEM_OPTIN);
    return fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(reg().mu);
  reg().smem[func] = value;
  return cudaSuccess;
}

} /* extern "C" */

/* ------------------------------------------------------------------------------------------ */
/* The products: shared by cuBLAS and cuBLASLt                                                 */
/* ------------------------------------------------------------------------------------------ */

/* One operand as stored: column-major rows x cols (before its op), leading dimension and batch
 * stride in elements, fp32 or bf16. */
typedef struct {
  const void *p;
  cudaDataType_t type;
  int64_t rows, cols, ld, stride;
} mat_t;

typedef enum { EPI_NONE, EPI_BIAS, EPI_DGELU, EPI_GELU_AUX } epi_kind_t;

/* What is done to each element after alpha op(A) op(B) + beta C (cuBLASLt's epilogues). */
typedef struct {
  epi_kind_t kind;
  const void *bias; /* m values of bias_type (EPI_BIAS; EPI_GELU_AUX where not NULL) */
  cudaDataType_t bias_type;
  void *aux; /* m x n, ld aux_ld, of aux_type: the GELU's input (DGELU reads it, GELU_AUX writes) */
  cudaDataType_t aux_type;
  int64_t aux_ld;
} epi_t;

static size_t type_bytes(cudaDataType_t t)
{
  return t == CUDA_R_16BF ? 2 : 4;
}

static const char *type_name(cudaDataType_t t)
{
  return t == CUDA_R_32F ? "fp32" : t == CUDA_R_16BF ? "bf16" : "unsupported type";
}

/* Element i of an fp32 or bf16 array, exactly (a bf16 is the top half of an fp32). */
static float load(const void *p, cudaDataType_t t, int64_t i)
{
  float f;
  if (t == CUDA_R_16BF) {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, sizeof h);
    const uint32_t u = (uint32_t)h << 16;
    memcpy(&f, &u, sizeof f);
  } else {
    memcpy(&f, (const char *)p + 4 * i, sizeof f);
  }
  return f;
}

/* Element i of an fp32 or bf16 array = v: a bf16 gets v rounded to the nearest bf16, ties to
 * even (a NaN stays a quiet NaN), as cuBLASLt converts its fp32 results to a bf16 output. */
static void store(void *p, cudaDataType_t t, int64_t i, float v)
{
  if (t != CUDA_R_16BF) {
    memcpy((char *)p + 4 * i, &v, sizeof v);
    return;
  }
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    u |= 0x00400000u;
  else
    u += 0x7fffu + ((u >> 16) & 1u);
  const uint16_t h = (uint16_t)(u >> 16);
  memcpy((char *)p + 2 * i, &h, sizeof h);
}

/* out[i * c + l] = op(M)(i, l) of batch b, where op(M), r x c, is M (t false) or M^T. */
static void gather(const mat_t &M, int64_t b, bool t, float *out)
{
  const int64_t r = t ? M.cols : M.rows, c = t ? M.rows : M.cols, base = b * M.stride;
  if (t) {
    for (int64_t i = 0; i < r; i++)
      for (int64_t l = 0; l < c; l++)
        out[i * c + l] = load(M.p, M.type, base + l + i * M.ld);
  } else {
    for (int64_t l = 0; l < c; l++)
      for (int64_t i = 0; i < r; i++)
        out[i * c + l] = load(M.p, M.type, base + i + l * M.ld);
  }
}

/* op(M) of batch b (t: M^T) by rows of contiguous values, *ld apart: M's own memory where it is
 * fp32 and stored so (M^T's rows are M's columns), else a copy in buf (which may throw). */
static const float *by_rows(const mat_t &M, int64_t b, bool t, std::vector<float> &buf, int64_t *ld)
{
  if (t && M.type == CUDA_R_32F) {
    *ld = M.ld;
    return (const float *)M.p + b * M.stride;
  }
  buf.resize((size_t)(M.rows * M.cols));
  gather(M, b, t, buf.data());
  *ld = t ? M.rows : M.cols;
  return buf.data();
}

/* The GELU at x (tanh approximation), the expression of kernels/cpu/gelu.c's dt_cpu_gelu_forward
 * and kernels/cuda/gelu.cuh's gelu, in fp32 like them. */
static float gelu(float x)
{
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x); /* sqrt(2/pi) (...) */
  return 0.5f * x * (1.0f + tanhf(u));
}

/* The GELU's derivative at x (tanh approximation), the expression of kernels/cpu/gelu.c's
 * dt_cpu_gelu_backward and kernels/cuda/gelu.cuh's gelu_backward_kernel, in fp32 like them. */
static float gelu_grad(float x)
{
  const float s = 0.7978845608028654f; /* sqrt(2/pi) */
  const float u = s * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * s * (1.0f + 3.0f * 0.044715f * x * x);
}

/* The products' inner loops are not instrumented by the sanitizers (in their build they cost 70%
 * of test_cuda_on_emul's time): every operand's extent is checked against its live allocation
 * before a product runs (check_mat), and the results against the CPU's. */
#define DT_EMUL_HOT_LOOP __attribute__((no_sanitize("address", "undefined")))

/* sum_l x[l] y[l] over l = 0..k-1 in double, in DOT_LANES partial sums (l mod DOT_LANES) added
 * at the end: the adds of one chain wait on each other, and a single chain made the emulated
 * GPU's products the CI suites' largest cost. Each product of two floats is exact in double. */
#define DOT_LANES 8
static double lane_sum(const double *s) /* the partial sums' total, in their order */
{
  double sum = 0.0;
  for (int u = 0; u < DOT_LANES; u++)
    sum += s[u];
  return sum;
}

DT_EMUL_HOT_LOOP static double dot(const float *x, const float *y, int64_t k)
{
  double s[DOT_LANES] = {};
  int64_t l = 0;
  for (; l + DOT_LANES <= k; l += DOT_LANES)
#pragma GCC unroll 8
    for (int u = 0; u < DOT_LANES; u++)
      s[u] += (double)x[l + u] * (double)y[l + u];
  for (; l < k; l++)
    s[l % DOT_LANES] += (double)x[l] * (double)y[l];
  return lane_sum(s);
}

/* The sums of column bj (k values) with every row of op(A), as dot() sums them (the same
 * bits), op(A) read in place: its element (i, l) at A.p's base + i si + l sl. lanes holds
 * m DOT_LANES partial sums. For a product of a few columns, where copying op(A) would cost more
 * than the product (the cuBLAS fallback stages a bf16 output one block of columns at a time). */
DT_EMUL_HOT_LOOP static void sums_in_place(const mat_t &A, int64_t base, int64_t si, int64_t sl,
                                           const float *bj, int64_t m, int64_t k, double *lanes,
                                           double *out)
{
  std::fill(lanes, lanes + m * DOT_LANES, 0.0);
  auto add = [&](int64_t i, int64_t l) {
    lanes[i * DOT_LANES + l % DOT_LANES] +=
        (double)load(A.p, A.type, base + i * si + l * sl) * (double)bj[l];
  };
  /* along A's memory (l inner where it is contiguous in l, else i); either order adds each
   * lane's terms in the order of l */
  if (sl == 1) {
    for (int64_t i = 0; i < m; i++)
      for (int64_t l = 0; l < k; l++)
        add(i, l);
  } else {
    for (int64_t l = 0; l < k; l++)
      for (int64_t i = 0; i < m; i++)
        add(i, l);
  }
  for (int64_t i = 0; i < m; i++)
    out[i] = lane_sum(lanes + i * DOT_LANES);
}

/* Batch b of D (m x n, ldd) = alpha op(A) op(B) + beta C (ldc), then the epilogue; C and D
 * point at batch b's matrices, both of type cd. Each element's sum runs over l = 0..k-1 in
 * double (dot); the result is rounded to fp32 once (the bias added before, the GELU or its
 * derivative applied after, as the cuBLAS fallback of matmul.cu does it: bias seeded into C, the
 * GELU's kernels on the stored product), then to a bf16 D's type; GELU_AUX stores the GELU's
 * input x, so rounded, in aux and GELU(x) in D. False when the host is out of memory. */
static bool product(int64_t m, int64_t n, int64_t k, float alpha, const mat_t &A, bool ta,
                    const mat_t &B, bool tb, float beta, const void *C, int64_t ldc, void *D,
                    int64_t ldd, cudaDataType_t cd, const epi_t &epi, int64_t b)
{
  const bool reads_ab = alpha != 0.0f && k > 0;
  const bool in_place = reads_ab && n < 16 && !(ta && A.type == CUDA_R_32F);
  std::vector<float> abuf, bbuf;
  std::vector<double> lanes, col;
  const float *a = NULL, *bt = NULL; /* op(A) by rows, op(B) by columns: k contiguous values each */
  int64_t lda = 0, ldb = 0;
  try {
    if (reads_ab)
      bt = by_rows(B, b, !tb, bbuf, &ldb); /* op(B)^T's rows are op(B)'s columns */
    if (in_place) {
      lanes.resize((size_t)(m * DOT_LANES));
      col.resize((size_t)m);
    } else if (reads_ab) {
      a = by_rows(A, b, ta, abuf, &lda);
    }
  } catch (...) { /* no exception leaves this file: out of host memory is a status */
    return false;
  }
  /* columns per pass: each row of op(A) is read once per pass (in place: one, into col) */
  const int64_t JB = in_place ? 1 : 8;
  for (int64_t j0 = 0; j0 < n; j0 += JB) {
    const int64_t j1 = j0 + JB < n ? j0 + JB : n;
    if (in_place) /* op(A)'s element (i, l): A's (l, i) (ta) or (i, l) */
      sums_in_place(A, b * A.stride, ta ? A.ld : 1, ta ? 1 : A.ld, bt + j0 * ldb, m, k,
                    lanes.data(), col.data());
    for (int64_t i = 0; i < m; i++) {
      for (int64_t j = j0; j < j1; j++) {
        double t = 0.0;
        if (reads_ab)
          t = (double)alpha * (in_place ? col[i] : dot(a + i * lda, bt + j * ldb, k));
        if (beta != 0.0f)
          t += (double)beta * (double)load(C, cd, i + j * ldc);
        if (epi.bias)
          t += (double)load(epi.bias, epi.bias_type, i);
        float v = (float)t;
        if (epi.kind == EPI_DGELU)
          v = gelu_grad(load(epi.aux, epi.aux_type, i + j * epi.aux_ld)) * v;
        if (epi.kind == EPI_GELU_AUX) {
          store(epi.aux, epi.aux_type, i + j * epi.aux_ld, v);
          v = gelu(v);
        }
        store(D, cd, i + j * ldd, v);
      }
    }
  }
  return true;
}

/* product() for queued work, which has no status to return: out of host memory ends the test. */
static void product_or_die(const char *fn, int64_t m, int64_t n, int64_t k, float alpha,
                           const mat_t &A, bool ta, const mat_t &B, bool tb, float beta,
                           const void *C, int64_t ldc, void *D, int64_t ldd, cudaDataType_t cd,
                           const epi_t &epi, int64_t b)
{
  if (!product(m, n, k, alpha, A, ta, B, tb, beta, C, ldc, D, ldd, cd, epi, b)) {
    report("%s: out of host memory for a %lld x %lld x %lld product", fn, (long long)m,
           (long long)n, (long long)k);
    abort();
  }
}

/* Checks a matrix operand with rows, cols, batch >= 1: its pointer is aligned to its elements
 * and its whole extent, every batch's, lies in one live allocation of GPU `device`. The extent
 * runs from the lowest batch's first element to the highest's last, (cols - 1) ld + rows - 1. */
static bool check_mat(const char *fn, const char *name, const mat_t &M, int64_t batch, int device)
{
  const size_t es = type_bytes(M.type);
  char what[160];
  snprintf(what, sizeof what, "%s (%lld x %lld as stored, ld %lld, %s", name, (long long)M.rows,
           (long long)M.cols, (long long)M.ld, type_name(M.type));
  if (batch > 1)
    snprintf(what + strlen(what), sizeof what - strlen(what), ", %lld batches %lld apart",
             (long long)batch, (long long)M.stride);
  snprintf(what + strlen(what), sizeof what - strlen(what), ")");
  if ((uintptr_t)M.p % es) {
    report("%s: %s at %p is not aligned to its %zu-byte elements", fn, what, M.p, es);
    return false;
  }
  /* elements from M.p: batch 0 spans [0, last], batch i [i stride, i stride + last] */
  int64_t last = 0, shift = 0, hi = 0, span = 0;
  bool over = __builtin_mul_overflow(M.cols - 1, M.ld, &last) ||
              __builtin_add_overflow(last, M.rows - 1, &last) ||
              __builtin_mul_overflow(batch - 1, M.stride, &shift);
  const int64_t lo = !over && shift < 0 ? shift : 0; /* a negative stride starts below M.p */
  over = over || __builtin_add_overflow(shift > 0 ? shift : 0, last, &hi) ||
         __builtin_sub_overflow(hi, lo, &span) || span == INT64_MAX ||
         (uint64_t)(span + 1) > UINT64_MAX / es;
  if (over) {
    report("%s: %s: its extent overflows", fn, what);
    return false;
  }
  const uintptr_t start = (uintptr_t)M.p - (uintptr_t)(-lo) * es;
  return device_range(fn, what, (const void *)start, (uint64_t)(span + 1) * es, device);
}

/* ------------------------------------------------------------------------------------------ */
/* cuBLAS                                                                                      */
/* ------------------------------------------------------------------------------------------ */

struct cublasContext {
  int device; /* current when it was created: its work runs there */
  cudaStream_t stream;
  cublasMath_t mode;
};

/* A call's handle checks: live (else NOT_INITIALIZED, as cuBLAS says of a NULL one), its stream
 * still alive and its GPU current (else EXECUTION_FAILED: a GPU would fail to run the work). */
static cublasStatus_t blas_enter(const char *fn, cublasHandle_t h)
{
  if (!live_handle(h, K_BLAS)) {
    report("%s: %p is not a live cuBLAS handle", fn, (void *)h);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (!stream_ok(h->stream)) {
    report("%s: the handle's stream %p was destroyed", fn, (void *)h->stream);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  if (h->device != t_device) {
    report("%s: the handle is GPU %d's, but GPU %d is current", fn, h->device, t_device);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

static bool valid_op(cublasOperation_t op)
{
  return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

/* The reference BLAS's argument checks of xGEMM (xerbla's order), with the argument named. */
static bool gemm_args(const char *fn, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                      int k, int lda, int ldb, int ldc)
{
  const int arow = ta == CUBLAS_OP_N ? m : k, brow = tb == CUBLAS_OP_N ? k : n;
  if (!valid_op(ta) || !valid_op(tb))
    report("%s: trans%c = %d is not an operation", fn, valid_op(ta) ? 'b' : 'a',
           valid_op(ta) ? (int)tb : (int)ta);
  else if (m < 0 || n < 0 || k < 0)
    report("%s: %s = %d < 0", fn, m < 0 ? "m" : n < 0 ? "n" : "k", m < 0 ? m : n < 0 ? n : k);
  else if (lda < (arow > 1 ? arow : 1))
    report("%s: lda = %d < max(1, %s = %d), A's stored rows", fn, lda,
           ta == CUBLAS_OP_N ? "m" : "k", arow);
  else if (ldb < (brow > 1 ? brow : 1))
    report("%s: ldb = %d < max(1, %s = %d), B's stored rows", fn, ldb,
           tb == CUBLAS_OP_N ? "k" : "n", brow);
  else if (ldc < (m > 1 ? m : 1))
    report("%s: ldc = %d < max(1, m = %d)", fn, ldc, m);
  else
    return true;
  return false;
}

/* The reference BLAS's argument checks of xGEMV, in its order. */
static bool gemv_args(const char *fn, cublasOperation_t trans, int m, int n, int lda, int incx,
                      int incy)
{
  if (!valid_op(trans))
    report("%s: trans = %d is not an operation", fn, (int)trans);
  else if (m < 0 || n < 0)
    report("%s: %s = %d < 0", fn, m < 0 ? "m" : "n", m < 0 ? m : n);
  else if (lda < (m > 1 ? m : 1))
    report("%s: lda = %d < max(1, m = %d)", fn, lda, m);
  else if (incx == 0 || incy == 0)
    report("%s: inc%c = 0", fn, incx == 0 ? 'x' : 'y');
  else
    return true;
  return false;
}

/* C = alpha op(A) op(B) + beta C for each of batch products (strides in elements): Sgemm,
 * SgemmStridedBatched and GemmEx. */
static cublasStatus_t blas_gemm(const char *fn, cublasHandle_t h, cublasOperation_t ta,
                                cublasOperation_t tb, int m, int n, int k, const float *alpha,
                                const void *A, cudaDataType_t at, int lda, long long sa,
                                const void *B, cudaDataType_t bt, int ldb, long long sb,
                                const float *beta, float *C, int ldc, long long sc, int batch)
{
  const cublasStatus_t s = blas_enter(fn, h);
  if (s != CUBLAS_STATUS_SUCCESS)
    return s;
  if (!alpha || !beta) {
    report("%s: alpha or beta is NULL", fn);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!gemm_args(fn, ta, tb, m, n, k, lda, ldb, ldc))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (batch < 0) {
    report("%s: batchCount = %d < 0", fn, batch);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0 || batch == 0)
    return CUBLAS_STATUS_SUCCESS;
  const bool tA = ta != CUBLAS_OP_N, tB = tb != CUBLAS_OP_N; /* C is T for real types */
  const mat_t mA = {A, at, tA ? k : m, tA ? m : k, lda, sa};
  const mat_t mB = {B, bt, tB ? n : k, tB ? k : n, ldb, sb};
  const mat_t mC = {C, CUDA_R_32F, m, n, ldc, sc};
  const bool reads_ab = *alpha != 0.0f && k > 0;
  if ((reads_ab &&
       (!check_mat(fn, "A", mA, batch, h->device) || !check_mat(fn, "B", mB, batch, h->device))) ||
      !check_mat(fn, "C", mC, batch, h->device))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!reads_ab && *beta == 1.0f) /* the reference BLAS's quick return */
    return CUBLAS_STATUS_SUCCESS;
  const epi_t none = {EPI_NONE, NULL, CUDA_R_32F, NULL, CUDA_R_32F, 0};
  const float al = *alpha, be = *beta; /* host scalars: read by the call */
  enqueue(h->stream, [=] {
    for (int b = 0; b < batch; b++) {
      float *Cb = C + (ptrdiff_t)b * sc;
      product_or_die(fn, m, n, k, al, mA, tA, mB, tB, be, Cb, ldc, Cb, ldc, CUDA_R_32F, none, b);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *handle)
{
  if (!handle)
    return CUBLAS_STATUS_INVALID_VALUE;
  *handle = NULL;
  if (gate() != cudaSuccess)
    return CUBLAS_STATUS_NOT_INITIALIZED; /* cuBLAS's word for no usable GPU */
  cublasContext *h = new (std::nothrow) cublasContext;
  if (!h)
    return CUBLAS_STATUS_ALLOC_FAILED;
  h->device = t_device;
  h->stream = NULL;
  h->mode = CUBLAS_DEFAULT_MATH;
  add_handle(h, K_BLAS);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle)
{
  if (!remove_handle(handle, K_BLAS)) {
    report("cublasDestroy_v2: %p is not a live cuBLAS handle", (void *)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId)
{
  if (!live_handle(handle, K_BLAS)) {
    report("cublasSetStream_v2: %p is not a live cuBLAS handle", (void *)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (!stream_ok(streamId)) {
    report("cublasSetStream_v2: %p is not a live stream", (void *)streamId);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->stream = streamId;
  return CUBLAS_STATUS_SUCCESS;
}

/* Only recorded: products here are plain fp32 whatever the mode, and the tests assert through
 * dt_emul_math_mode_tf32_seen that the trainer never allowed TF32. */
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode)
{
  const unsigned base =
      (unsigned)mode & ~(unsigned)CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
  if (!live_handle(handle, K_BLAS)) {
    report("cublasSetMathMode: %p is not a live cuBLAS handle", (void *)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH &&
      base != CUBLAS_PEDANTIC_MATH && base != CUBLAS_TF32_TENSOR_OP_MATH &&
      base != CUBLAS_FP32_EMULATED_BF16X9_MATH && base != CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH) {
    report("cublasSetMathMode: %d is not a math mode", (int)mode);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (base == CUBLAS_TF32_TENSOR_OP_MATH)
    g_tf32_seen.store(1);
  handle->mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t status)
{
  switch (status) {
  case CUBLAS_STATUS_SUCCESS:
    return "the operation completed successfully";
  case CUBLAS_STATUS_NOT_INITIALIZED:
    return "the library was not initialized";
  case CUBLAS_STATUS_ALLOC_FAILED:
    return "the resource allocation failed";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "an invalid numeric value was used as an argument";
  case CUBLAS_STATUS_ARCH_MISMATCH:
    return "an absent device architectural feature is required";
  case CUBLAS_STATUS_MAPPING_ERROR:
    return "an access to GPU memory space failed";
  case CUBLAS_STATUS_EXECUTION_FAILED:
    return "the GPU program failed to execute";
  case CUBLAS_STATUS_INTERNAL_ERROR:
    return "an internal operation failed";
  case CUBLAS_STATUS_NOT_SUPPORTED:
    return "the functionality requested is not supported";
  case CUBLAS_STATUS_LICENSE_ERROR:
    return "the functionality requested requires some license and an error was detected when "
           "trying to check the current licensing";
  default:
    return "unknown error";
  }
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const float *alpha,
                              const float *A, int lda, const float *B, int ldb, const float *beta,
                              float *C, int ldc)
{
  return blas_gemm("cublasSgemm_v2", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0,
                   B, CUDA_R_32F, ldb, 0, beta, C, ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long int strideA, const float *B, int ldb,
                                         long long int strideB, const float *beta, float *C,
                                         int ldc, long long int strideC, int batchCount)
{
  return blas_gemm("cublasSgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A,
                   CUDA_R_32F, lda, strideA, B, CUDA_R_32F, ldb, strideB, beta, C, ldc, strideC,
                   batchCount);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo)
{
  const char *fn = "cublasGemmEx";
  (void)algo; /* every algorithm computes the same here */
  if ((Atype != CUDA_R_32F && Atype != CUDA_R_16BF) || Btype != Atype || Ctype != CUDA_R_32F ||
      computeType != CUBLAS_COMPUTE_32F) {
    report("%s: A %d, B %d, C %d, compute %d is not emulated (A and B both CUDA_R_32F or "
           "CUDA_R_16BF, C CUDA_R_32F, CUBLAS_COMPUTE_32F)",
           fn, (int)Atype, (int)Btype, (int)Ctype, (int)computeType);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  /* CUBLAS_COMPUTE_32F: alpha and beta are floats */
  return blas_gemm(fn, handle, transa, transb, m, n, k, (const float *)alpha, A, Atype, lda, 0, B,
                   Btype, ldb, 0, (const float *)beta, (float *)C, ldc, 0, 1);
}

cublasStatus_t cublasSgemv_v2(cublasHandle_t handle, cublasOperation_t trans, int m, int n,
                              const float *alpha, const float *A, int lda, const float *x, int incx,
                              const float *beta, float *y, int incy)
{
  const char *fn = "cublasSgemv_v2";
  const cublasStatus_t s = blas_enter(fn, handle);
  if (s != CUBLAS_STATUS_SUCCESS)
    return s;
  if (!alpha || !beta) {
    report("%s: alpha or beta is NULL", fn);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!gemv_args(fn, trans, m, n, lda, incx, incy))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0)
    return CUBLAS_STATUS_SUCCESS;
  const bool t = trans != CUBLAS_OP_N;
  const int64_t lenx = t ? m : n, leny = t ? n : m;
  const int64_t ax = incx > 0 ? incx : -(int64_t)incx, ay = incy > 0 ? incy : -(int64_t)incy;
  const mat_t mA = {A, CUDA_R_32F, m, n, lda, 0};
  const mat_t mx = {x, CUDA_R_32F, 1, lenx, ax, 0}, my = {y, CUDA_R_32F, 1, leny, ay, 0};
  const bool reads_ax = *alpha != 0.0f;
  if ((reads_ax && (!check_mat(fn, "A", mA, 1, handle->device) ||
                    !check_mat(fn, "x", mx, 1, handle->device))) ||
      !check_mat(fn, "y", my, 1, handle->device))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!reads_ax && *beta == 1.0f)
    return CUBLAS_STATUS_SUCCESS;
  /* A negative increment walks its vector from the far end (x points at its lowest element). */
  const int64_t kx = incx > 0 ? 0 : (lenx - 1) * ax, ky = incy > 0 ? 0 : (leny - 1) * ay;
  const float al = *alpha, be = *beta; /* host scalars: read by the call */
  enqueue(handle->stream, [=] {
    std::vector<double> acc((size_t)leny, 0.0);
    if (reads_ax) /* acc[e] sums over f = 0..lenx-1 in order, whichever loop is outside */
      for (int64_t f = 0; f < lenx; f++) {
        const double xf = (double)x[kx + f * incx];
        for (int64_t e = 0; e < leny; e++)
          acc[(size_t)e] += (double)(t ? A[f + e * (int64_t)lda] : A[e + f * (int64_t)lda]) * xf;
      }
    for (int64_t e = 0; e < leny; e++) {
      float *ye = &y[ky + e * incy];
      double v = reads_ax ? (double)al * acc[(size_t)e] : 0.0;
      if (be != 0.0f)
        v += (double)be * (double)*ye;
      *ye = (float)v;
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */

/* ------------------------------------------------------------------------------------------ */
/* cuBLASLt                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* The descriptors are this file's own structs behind the header's pointer types (the Create
 * functions hand out pointers, so nothing needs to fit the opaque arrays); the registry says
 * which pointers are live descriptors of which kind. */
struct cublasLtContext {
  int device;
};

typedef struct {
  int32_t compute, scale, transa, transb;
  uint32_t epilogue;
  const void *bias;
  int32_t bias_type; /* -1: the type of D */
  const void *aux;
  int64_t aux_ld;
  int32_t aux_type; /* -1: the type of D */
} lt_desc_t;

typedef struct {
  uint32_t type;
  int32_t order;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch;
  int64_t stride;
} lt_layout_t;

typedef struct {
  uint64_t max_ws;
  uint32_t align[4]; /* A, B, C, D */
} lt_pref_t;

/* The heuristic's mark in the algorithm it returns, checked by cublasLtMatmul. */
#define LT_ALGO_MARK 0x64746c7461686f73ull
#define LT_ALGOS     3

/* One attribute: where it lives and its exact size (cuBLASLt refuses any other). */
typedef struct {
  void *p;
  size_t bytes;
  const char *name;
} field_t;

/* One attribute of a descriptor struct: where it lives in it and its exact size. */
typedef struct {
  int attr;
  size_t offset, bytes;
  const char *name;
} attr_t;

#define ATTR(prefix, name, type, member)                                                           \
  {                                                                                                \
    prefix##name, offsetof(type, member), sizeof(((type *)0)->member), #name                       \
  }

static const attr_t DESC_ATTRS[] = {
    ATTR(CUBLASLT_MATMUL_DESC_, COMPUTE_TYPE, lt_desc_t, compute),
    ATTR(CUBLASLT_MATMUL_DESC_, SCALE_TYPE, lt_desc_t, scale),
    ATTR(CUBLASLT_MATMUL_DESC_, TRANSA, lt_desc_t, transa),
    ATTR(CUBLASLT_MATMUL_DESC_, TRANSB, lt_desc_t, transb),
    ATTR(CUBLASLT_MATMUL_DESC_, EPILOGUE, lt_desc_t, epilogue),
    ATTR(CUBLASLT_MATMUL_DESC_, BIAS_POINTER, lt_desc_t, bias),
    ATTR(CUBLASLT_MATMUL_DESC_, BIAS_DATA_TYPE, lt_desc_t, bias_type),
    ATTR(CUBLASLT_MATMUL_DESC_, EPILOGUE_AUX_POINTER, lt_desc_t, aux),
    ATTR(CUBLASLT_MATMUL_DESC_, EPILOGUE_AUX_LD, lt_desc_t, aux_ld),
    ATTR(CUBLASLT_MATMUL_DESC_, EPILOGUE_AUX_DATA_TYPE, lt_desc_t, aux_type),
};

static const attr_t LAYOUT_ATTRS[] = {
    ATTR(CUBLASLT_MATRIX_LAYOUT_, TYPE, lt_layout_t, type),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, ORDER, lt_layout_t, order),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, ROWS, lt_layout_t, rows),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, COLS, lt_layout_t, cols),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, LD, lt_layout_t, ld),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, BATCH_COUNT, lt_layout_t, batch),
    ATTR(CUBLASLT_MATRIX_LAYOUT_, STRIDED_BATCH_OFFSET, lt_layout_t, stride),
};

static const attr_t PREF_ATTRS[] = {
    ATTR(CUBLASLT_MATMUL_PREF_, MAX_WORKSPACE_BYTES, lt_pref_t, max_ws),
    ATTR(CUBLASLT_MATMUL_PREF_, MIN_ALIGNMENT_A_BYTES, lt_pref_t, align[0]),
    ATTR(CUBLASLT_MATMUL_PREF_, MIN_ALIGNMENT_B_BYTES, lt_pref_t, align[1]),
    ATTR(CUBLASLT_MATMUL_PREF_, MIN_ALIGNMENT_C_BYTES, lt_pref_t, align[2]),
    ATTR(CUBLASLT_MATMUL_PREF_, MIN_ALIGNMENT_D_BYTES, lt_pref_t, align[3]),
};

/* The field of attribute a in descriptor d, from its table; false if the emulation lacks a. */
template <size_t N> static bool find_field(void *d, const attr_t (&table)[N], int a, field_t *f)
{
  for (size_t i = 0; i < N; i++)
    if (table[i].attr == a) {
      *f = field_t{(char *)d + table[i].offset, table[i].bytes, table[i].name};
      return true;
    }
  return false;
}

static bool desc_field(lt_desc_t *d, cublasLtMatmulDescAttributes_t a, field_t *f)
{
  return find_field(d, DESC_ATTRS, (int)a, f);
}

static bool layout_field(lt_layout_t *l, cublasLtMatrixLayoutAttribute_t a, field_t *f)
{
  return find_field(l, LAYOUT_ATTRS, (int)a, f);
}

static bool pref_field(lt_pref_t *p, cublasLtMatmulPreferenceAttributes_t a, field_t *f)
{
  return find_field(p, PREF_ATTRS, (int)a, f);
}

/* A live descriptor of kind k (its struct T), or NULL with h reported as stray. */
template <typename T> static T *lt_live(const char *fn, const void *h, kind_t k, const char *what)
{
  if (live_handle(h, k))
    return (T *)h;
  report("%s: %p is not a live %s", fn, h, what);
  return NULL;
}

/* A Destroy: deletes a live descriptor of kind k (its struct T). */
template <typename T>
static cublasStatus_t lt_destroy(const char *fn, const void *h, kind_t k, const char *what)
{
  if (!remove_handle(h, k)) {
    report("%s: %p is not a live %s", fn, h, what);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  delete (T *)h;
  return CUBLAS_STATUS_SUCCESS;
}

/* A SetAttribute of d (NULL: a stray handle, already reported): an emulated attribute, a buffer
 * of exactly its size, a value valid(f, buf) accepts (it reports a refusal: the values
 * cuBLASLt refuses as they are set). */
template <typename T, typename A, typename V>
static cublasStatus_t lt_set(const char *fn, T *d, bool (*field)(T *, A, field_t *), A attr,
                             const void *buf, size_t bytes, V valid)
{
  if (!d)
    return CUBLAS_STATUS_INVALID_VALUE;
  field_t f = {NULL, 0, NULL};
  if (!field(d, attr, &f)) {
    report("%s: attribute %d is not emulated", fn, (int)attr);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!buf || bytes != f.bytes) {
    report("%s: %s takes %zu bytes, given %zu%s", fn, f.name, f.bytes, bytes,
           buf ? "" : " at NULL");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!valid(f, buf))
    return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(f.p, buf, f.bytes);
  return CUBLAS_STATUS_SUCCESS;
}

/* Every value of the attribute's type is accepted. */
static bool any_value(const field_t &, const void *)
{
  return true;
}

/* A GetAttribute of d (NULL: a stray handle, already reported): size 0 asks for the size;
 * otherwise it must be exact. */
template <typename T, typename A>
static cublasStatus_t lt_get(const char *fn, T *d, bool (*field)(T *, A, field_t *), A attr,
                             void *buf, size_t bytes, size_t *written)
{
  if (!d)
    return CUBLAS_STATUS_INVALID_VALUE;
  field_t f = {NULL, 0, NULL};
  if (!field(d, attr, &f)) {
    report("%s: attribute %d is not emulated", fn, (int)attr);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (bytes == 0) {
    if (!written)
      return CUBLAS_STATUS_INVALID_VALUE;
    *written = f.bytes;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (!buf || bytes != f.bytes) {
    report("%s: %s is %zu bytes, asked for %zu", fn, f.name, f.bytes, bytes);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  memcpy(buf, f.p, bytes);
  if (written)
    *written = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

static bool valid_epilogue(uint32_t e)
{
  switch (e) {
  case CUBLASLT_EPILOGUE_DEFAULT:
  case CUBLASLT_EPILOGUE_RELU:
  case CUBLASLT_EPILOGUE_RELU_AUX:
  case CUBLASLT_EPILOGUE_BIAS:
  case CUBLASLT_EPILOGUE_RELU_BIAS:
  case CUBLASLT_EPILOGUE_RELU_AUX_BIAS:
  case CUBLASLT_EPILOGUE_DRELU:
  case CUBLASLT_EPILOGUE_DRELU_BGRAD:
  case CUBLASLT_EPILOGUE_GELU:
  case CUBLASLT_EPILOGUE_GELU_AUX:
  case CUBLASLT_EPILOGUE_GELU_BIAS:
  case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
  case CUBLASLT_EPILOGUE_DGELU:
  case CUBLASLT_EPILOGUE_DGELU_BGRAD:
  case CUBLASLT_EPILOGUE_BGRADA:
  case CUBLASLT_EPILOGUE_BGRADB:
    return true;
  default:
    return false;
  }
}

/* A product as cublasLtMatmulAlgoGetHeuristic and cublasLtMatmul see it, resolved from copies
 * of its descriptors. */
typedef struct {
  lt_desc_t op;
  lt_layout_t A, B, C, D;
  int64_t m, n, k, batch;
  bool ta, tb;
  epi_kind_t epi;
  bool biased; /* the epilogue adds the bias (BIAS, GELU_AUX_BIAS) */
  cudaDataType_t ab, bias_type, aux_type;
} lt_problem_t;

/* Copies the descriptors out (each must be live), then checks what the emulation computes
 * (NOT_SUPPORTED otherwise: cuBLASLt has no algorithm) and that the shapes agree (INVALID_VALUE
 * otherwise, with the mismatch reported). The semantics, from cuBLASLt's documentation
 * (cublasLt.h of CUDA 13, as docs.nvidia.com/cuda/cublas states them):
 * - D = alpha op(A) op(B) + beta C, then the epilogue: "Bias, apply (broadcasted) Bias from
 *   bias vector. Bias vector length must match matrix D rows, it must be packed (stride between
 *   vector elements is 1). Bias vector is broadcasted to all columns and added before applying
 *   final postprocessing." (CUBLASLT_EPILOGUE_BIAS)
 * - "GELU gradient. Apply GELU gradient to matmul output. Store GELU gradient in the output
 *   matrix. This epilogue mode requires an extra input, see
 *   CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER." (CUBLASLT_EPILOGUE_DGELU): the aux matrix is the
 *   GELU's input as GELU_AUX stored it, whose leading dimension "Must be divisible by 8 and be
 *   no less than the number of rows in the output matrix" (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD).
 *   So D(i, j) = GELU'(aux[i + j aux_ld]) * (the product's element), GELU' of the tanh
 *   approximation (the GPT-2 GELU, gelu_grad above).
 * - "GELU and Bias, apply Bias and then GELU transform. This epilogue mode outputs GELU input
 *   as a separate matrix (useful for training)." (CUBLASLT_EPILOGUE_GELU_AUX_BIAS; GELU_AUX
 *   without the bias): the aux matrix is the "Output of GELU input matrix in forward pass", with
 *   DGELU's rule on its leading dimension; so aux(i, j) = x and D(i, j) = GELU(x) for each
 *   element x of the product, the bias added, each rounded to its matrix's type.
 * - The bias and aux types default (-1) to D's ("Bias vector elements are the same type as the
 *   elements of output matrix (Dtype)"; CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, _AUX_DATA_TYPE).
 *   A bias of another type is NOT_SUPPORTED, as on an H200 with CUDA 13's cuBLASLt, which had
 *   no algorithm for an fp32 bias with a bf16 D (the exceptions listed are IMMA and fp8). */
static cublasStatus_t lt_resolve(const char *fn, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t A,
                                 cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                                 cublasLtMatrixLayout_t D, lt_problem_t *p)
{
  static const char *const names[4] = {"Adesc", "Bdesc", "Cdesc", "Ddesc"};
  const cublasLtMatrixLayout_t lay[4] = {A, B, C, D};
  lt_layout_t *dst[4] = {&p->A, &p->B, &p->C, &p->D};
  if (!live_handle(op, K_LT_DESC)) {
    report("%s: %p is not a live matmul descriptor", fn, (void *)op);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  p->op = *reinterpret_cast<const lt_desc_t *>(op);
  for (int i = 0; i < 4; i++) {
    if (!live_handle(lay[i], K_LT_LAYOUT)) {
      report("%s: %s %p is not a live matrix layout", fn, names[i], (void *)lay[i]);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    *dst[i] = *reinterpret_cast<const lt_layout_t *>(lay[i]);
  }

  /* what is emulated */
  const lt_desc_t &o = p->op;
  const char *why = NULL;
  p->ab = (cudaDataType_t)p->A.type;
  p->epi =
      o.epilogue == CUBLASLT_EPILOGUE_BIAS    ? EPI_BIAS
      : o.epilogue == CUBLASLT_EPILOGUE_DGELU ? EPI_DGELU
      : o.epilogue == CUBLASLT_EPILOGUE_GELU_AUX || o.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS
          ? EPI_GELU_AUX
          : EPI_NONE;
  p->biased = o.epilogue == CUBLASLT_EPILOGUE_BIAS || o.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool has_aux = p->epi == EPI_DGELU || p->epi == EPI_GELU_AUX;
  p->bias_type = o.bias_type == -1 ? (cudaDataType_t)p->D.type : (cudaDataType_t)o.bias_type;
  p->aux_type = o.aux_type == -1 ? (cudaDataType_t)p->D.type : (cudaDataType_t)o.aux_type;
  if (o.compute != CUBLAS_COMPUTE_32F)
    why = "compute type (CUBLAS_COMPUTE_32F only)";
  else if (o.scale != CUDA_R_32F)
    why = "scale type (CUDA_R_32F only)";
  else if ((p->ab != CUDA_R_32F && p->ab != CUDA_R_16BF) || p->B.type != p->A.type)
    why = "A and B types (both CUDA_R_32F or both CUDA_R_16BF only)";
  else if ((p->D.type != CUDA_R_32F && p->D.type != CUDA_R_16BF) || p->C.type != p->D.type)
    why = "C and D types (both CUDA_R_32F or both CUDA_R_16BF only)";
  else if (p->A.order != CUBLASLT_ORDER_COL || p->B.order != CUBLASLT_ORDER_COL ||
           p->C.order != CUBLASLT_ORDER_COL || p->D.order != CUBLASLT_ORDER_COL)
    why = "matrix order (CUBLASLT_ORDER_COL only)";
  else if (o.epilogue != CUBLASLT_EPILOGUE_DEFAULT && p->epi == EPI_NONE)
    why = "epilogue (DEFAULT, BIAS, GELU_AUX, GELU_AUX_BIAS and DGELU only)";
  else if (p->biased && p->bias_type != (cudaDataType_t)p->D.type)
    why = "bias type (D's only: the documented exceptions are IMMA and fp8 kernels)";
  else if (has_aux && p->aux_type != CUDA_R_32F && p->aux_type != CUDA_R_16BF)
    why = "aux type (CUDA_R_32F or CUDA_R_16BF only)";
  for (int i = 0; i < 4 && !why; i++)
    if (dst[i]->rows > INT32_MAX || dst[i]->cols > INT32_MAX)
      why = "matrix size (rows and columns up to 2^31 - 1)";
  if (why) {
    report("%s: not emulated: %s; compute %d, scale %d, types A %u B %u C %u D %u, epilogue %u", fn,
           why, (int)o.compute, (int)o.scale, p->A.type, p->B.type, p->C.type, p->D.type,
           o.epilogue);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }

  /* the shapes: op(A) m x k, op(B) k x n, C and D m x n */
  p->ta = o.transa != CUBLAS_OP_N;
  p->tb = o.transb != CUBLAS_OP_N;
  p->m = (int64_t)p->D.rows;
  p->n = (int64_t)p->D.cols;
  p->k = (int64_t)(p->ta ? p->A.rows : p->A.cols);
  p->batch = p->D.batch;
  const int64_t am = (int64_t)(p->ta ? p->A.cols : p->A.rows);
  const int64_t bk = (int64_t)(p->tb ? p->B.cols : p->B.rows);
  const int64_t bn = (int64_t)(p->tb ? p->B.rows : p->B.cols);
  if (am != p->m || bk != p->k || bn != p->n) {
    report("%s: op(A) is %lld x %lld and op(B) %lld x %lld (trans %c%c), but D is %lld x %lld", fn,
           (long long)am, (long long)p->k, (long long)bk, (long long)bn, p->ta ? 'T' : 'N',
           p->tb ? 'T' : 'N', (long long)p->m, (long long)p->n);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p->C.rows != p->D.rows || p->C.cols != p->D.cols) {
    report("%s: C is %llu x %llu, D %llu x %llu", fn, (unsigned long long)p->C.rows,
           (unsigned long long)p->C.cols, (unsigned long long)p->D.rows,
           (unsigned long long)p->D.cols);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (int i = 0; i < 4; i++) {
    const int64_t rows = (int64_t)dst[i]->rows;
    if (dst[i]->ld < (rows > 1 ? rows : 1)) {
      report("%s: %s's leading dimension %lld is less than max(1, its %lld rows)", fn, names[i],
             (long long)dst[i]->ld, (long long)rows);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (dst[i]->batch != p->D.batch || dst[i]->batch < 1) {
      report("%s: batch counts A %d, B %d, C %d, D %d (equal and at least 1)", fn, p->A.batch,
             p->B.batch, p->C.batch, p->D.batch);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  if (has_aux && (o.aux_ld < (p->m > 1 ? p->m : 1) || o.aux_ld % 8)) {
    report("%s: EPILOGUE_AUX_LD %lld must be a multiple of 8 and at least D's %lld rows", fn,
           (long long)o.aux_ld, (long long)p->m);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

/* The bytes each pointer operand needs to be aligned to: its element size. */
static bool aligned_to(const void *p, size_t bytes)
{
  return (uintptr_t)p % bytes == 0;
}

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *lightHandle)
{
  if (!lightHandle)
    return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = NULL;
  if (gate() != cudaSuccess)
    return CUBLAS_STATUS_NOT_INITIALIZED;
  cublasLtContext *h = new (std::nothrow) cublasLtContext;
  if (!h)
    return CUBLAS_STATUS_ALLOC_FAILED;
  h->device = t_device;
  add_handle(h, K_LT);
  *lightHandle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle)
{
  if (!remove_handle(lightHandle, K_LT)) {
    report("cublasLtDestroy: %p is not a live cuBLASLt handle", (void *)lightHandle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *matmulDesc,
                                        cublasComputeType_t computeType, cudaDataType_t scaleType)
{
  if (!matmulDesc)
    return CUBLAS_STATUS_INVALID_VALUE;
  lt_desc_t *d = new (std::nothrow) lt_desc_t;
  if (!d)
    return CUBLAS_STATUS_ALLOC_FAILED;
  d->compute = (int32_t)computeType;
  d->scale = (int32_t)scaleType;
  d->transa = d->transb = CUBLAS_OP_N;
  d->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  d->bias = NULL;
  d->bias_type = -1;
  d->aux = NULL;
  d->aux_ld = 0;
  d->aux_type = -1;
  add_handle(d, K_LT_DESC);
  *matmulDesc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc)
{
  return lt_destroy<lt_desc_t>("cublasLtMatmulDescDestroy", matmulDesc, K_LT_DESC,
                               "matmul descriptor");
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t sizeInBytes)
{
  const char *fn = "cublasLtMatmulDescSetAttribute";
  return lt_set(fn, lt_live<lt_desc_t>(fn, matmulDesc, K_LT_DESC, "matmul descriptor"), desc_field,
                attr, buf, sizeInBytes, [&](const field_t &f, const void *v) {
                  if (attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB) {
                    int32_t op;
                    memcpy(&op, v, sizeof op);
                    if (!valid_op((cublasOperation_t)op)) {
                      report("%s: %s = %d is not an operation", fn, f.name, (int)op);
                      return false;
                    }
                  } else if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE) {
                    uint32_t e;
                    memcpy(&e, v, sizeof e);
                    if (!valid_epilogue(e)) {
                      report("%s: EPILOGUE = %u is not a cublasLtEpilogue_t", fn, e);
                      return false;
                    }
                  } else if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD) {
                    int64_t ld;
                    memcpy(&ld, v, sizeof ld);
                    if (ld < 0) {
                      report("%s: EPILOGUE_AUX_LD = %lld < 0", fn, (long long)ld);
                      return false;
                    }
                  }
                  return true;
                });
}

cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, void *buf,
                                              size_t sizeInBytes, size_t *sizeWritten)
{
  const char *fn = "cublasLtMatmulDescGetAttribute";
  return lt_get(fn, lt_live<lt_desc_t>(fn, matmulDesc, K_LT_DESC, "matmul descriptor"), desc_field,
                attr, buf, sizeInBytes, sizeWritten);
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld)
{
  if (!matLayout)
    return CUBLAS_STATUS_INVALID_VALUE;
  /* Not validated here (ld < rows included): cuBLASLt checks the shapes when it runs. */
  lt_layout_t *l = new (std::nothrow) lt_layout_t;
  if (!l)
    return CUBLAS_STATUS_ALLOC_FAILED;
  l->type = (uint32_t)type;
  l->order = CUBLASLT_ORDER_COL;
  l->rows = rows;
  l->cols = cols;
  l->ld = ld;
  l->batch = 1;
  l->stride = 0;
  add_handle(l, K_LT_LAYOUT);
  *matLayout = reinterpret_cast<cublasLtMatrixLayout_t>(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout)
{
  return lt_destroy<lt_layout_t>("cublasLtMatrixLayoutDestroy", matLayout, K_LT_LAYOUT,
                                 "matrix layout");
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t sizeInBytes)
{
  const char *fn = "cublasLtMatrixLayoutSetAttribute";
  return lt_set(fn, lt_live<lt_layout_t>(fn, matLayout, K_LT_LAYOUT, "matrix layout"), layout_field,
                attr, buf, sizeInBytes, [&](const field_t &, const void *v) {
                  int32_t order;
                  memcpy(&order, v, sizeof order);
                  if (attr == CUBLASLT_MATRIX_LAYOUT_ORDER &&
                      (order < CUBLASLT_ORDER_COL || order > CUBLASLT_ORDER_COL32_2R_4R4)) {
                    report("%s: ORDER = %d is not a cublasLtOrder_t", fn, (int)order);
                    return false;
                  }
                  return true;
                });
}

cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t matLayout,
                                                cublasLtMatrixLayoutAttribute_t attr, void *buf,
                                                size_t sizeInBytes, size_t *sizeWritten)
{
  const char *fn = "cublasLtMatrixLayoutGetAttribute";
  return lt_get(fn, lt_live<lt_layout_t>(fn, matLayout, K_LT_LAYOUT, "matrix layout"), layout_field,
                attr, buf, sizeInBytes, sizeWritten);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref)
{
  if (!pref)
    return CUBLAS_STATUS_INVALID_VALUE;
  lt_pref_t *p = new (std::nothrow) lt_pref_t;
  if (!p)
    return CUBLAS_STATUS_ALLOC_FAILED;
  p->max_ws = 0; /* the defaults: no workspace, 256-byte alignment assumed of every pointer */
  for (int i = 0; i < 4; i++)
    p->align[i] = 256;
  add_handle(p, K_LT_PREF);
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(p);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref)
{
  return lt_destroy<lt_pref_t>("cublasLtMatmulPreferenceDestroy", pref, K_LT_PREF, "preference");
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t sizeInBytes)
{
  const char *fn = "cublasLtMatmulPreferenceSetAttribute";
  return lt_set(fn, lt_live<lt_pref_t>(fn, pref, K_LT_PREF, "preference"), pref_field, attr, buf,
                sizeInBytes, any_value);
}

/* Not called by the backend; test_cuda_lt reads its preferences back with it. */
cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    void *buf, size_t sizeInBytes,
                                                    size_t *sizeWritten)
{
  const char *fn = "cublasLtMatmulPreferenceGetAttribute";
  return lt_get(fn, lt_live<lt_pref_t>(fn, pref, K_LT_PREF, "preference"), pref_field, attr, buf,
                sizeInBytes, sizeWritten);
}

/* LT_ALGOS algorithms (no workspace; fewer where fewer are asked for) for every product the
 * emulation computes, all computing it alike (the tuning of matmul.cu times them), provided the
 * alignment the caller promises of each pointer (the preference's, and the bias and aux
 * pointers' own) is a whole number of elements; none otherwise, as a GPU's kernels need at
 * least that. */
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int *returnAlgoCount)
{
  const char *fn = "cublasLtMatmulAlgoGetHeuristic";
  if (!live_handle(lightHandle, K_LT)) {
    report("%s: %p is not a live cuBLASLt handle", fn, (void *)lightHandle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (requestedAlgoCount <= 0 || !heuristicResultsArray || !returnAlgoCount) {
    report("%s: requestedAlgoCount %d, results %p, returnAlgoCount %p", fn, requestedAlgoCount,
           (void *)heuristicResultsArray, (void *)returnAlgoCount);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *returnAlgoCount = 0;
  lt_pref_t pref = {0, {256, 256, 256, 256}};
  if (preference) {
    if (!live_handle(preference, K_LT_PREF)) {
      report("%s: %p is not a live preference", fn, (void *)preference);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    pref = *reinterpret_cast<const lt_pref_t *>(preference);
  }
  lt_problem_t p;
  const cublasStatus_t s = lt_resolve(fn, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
  if (s != CUBLAS_STATUS_SUCCESS)
    return s;
  const size_t ecd = type_bytes((cudaDataType_t)p.D.type);
  const size_t es[4] = {type_bytes(p.ab), type_bytes(p.ab), ecd, ecd};
  for (int i = 0; i < 4; i++)
    if (pref.align[i] % es[i])
      return CUBLAS_STATUS_SUCCESS; /* no algorithm */
  if ((p.biased && !aligned_to(p.op.bias, type_bytes(p.bias_type))) ||
      (p.epi != EPI_NONE && p.epi != EPI_BIAS && !aligned_to(p.op.aux, type_bytes(p.aux_type))))
    return CUBLAS_STATUS_SUCCESS;
  const int n = requestedAlgoCount < LT_ALGOS ? requestedAlgoCount : LT_ALGOS;
  for (int i = 0; i < n; i++) {
    cublasLtMatmulHeuristicResult_t *r = &heuristicResultsArray[i];
    memset(r, 0, sizeof *r);
    r->algo.data[0] = LT_ALGO_MARK;
    r->algo.data[1] = (uint64_t)i;
    r->workspaceSize = 0;
    r->state = CUBLAS_STATUS_SUCCESS;
    r->wavesCount = 1.0f;
  }
  *returnAlgoCount = n;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                              const void *alpha, const void *A, cublasLtMatrixLayout_t Adesc,
                              const void *B, cublasLtMatrixLayout_t Bdesc, const void *beta,
                              const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo,
                              void *workspace, size_t workspaceSizeInBytes, cudaStream_t stream)
{
  const char *fn = "cublasLtMatmul";
  if (!live_handle(lightHandle, K_LT)) {
    report("%s: %p is not a live cuBLASLt handle", fn, (void *)lightHandle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  const int dev = lightHandle->device;
  if (dev != t_device) {
    report("%s: the handle is GPU %d's, but GPU %d is current", fn, dev, t_device);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  if (!stream_ok(stream)) {
    report("%s: stream %p is not a live stream", fn, (void *)stream);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  lt_problem_t p;
  const cublasStatus_t s = lt_resolve(fn, computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
  if (s != CUBLAS_STATUS_SUCCESS)
    return s;
  if (!alpha || !beta) {
    report("%s: alpha or beta is NULL", fn);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (algo && (algo->data[0] != LT_ALGO_MARK || algo->data[1] >= LT_ALGOS)) {
    report("%s: the algorithm did not come from cublasLtMatmulAlgoGetHeuristic", fn);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (workspaceSizeInBytes &&
      !device_range(fn, "the workspace", workspace, workspaceSizeInBytes, dev))
    return CUBLAS_STATUS_INVALID_VALUE;
  const float al = *(const float *)alpha, be = *(const float *)beta; /* scale type fp32 */
  const size_t eab = type_bytes(p.ab);
  const cudaDataType_t cd = (cudaDataType_t)p.D.type;
  /* Without the preference here, each pointer must be at least element-aligned. */
  if (!aligned_to(A, eab) || !aligned_to(B, eab) || !aligned_to(C, type_bytes(cd)) ||
      !aligned_to(D, type_bytes(cd)) ||
      (p.biased && !aligned_to(p.op.bias, type_bytes(p.bias_type))) ||
      (p.epi != EPI_NONE && p.epi != EPI_BIAS && !aligned_to(p.op.aux, type_bytes(p.aux_type)))) {
    report("%s: a pointer is not aligned to its elements: A %p, B %p (%zu bytes), C %p, D %p, "
           "bias %p, aux %p",
           fn, A, B, eab, C, (void *)D, p.op.bias, p.op.aux);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (C == D && (p.C.ld != p.D.ld || p.C.stride != p.D.stride)) {
    report("%s: C is D (in place) but their layouts differ: ld %lld / %lld, batch stride %lld / "
           "%lld",
           fn, (long long)p.C.ld, (long long)p.D.ld, (long long)p.C.stride, (long long)p.D.stride);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p.m == 0 || p.n == 0)
    return CUBLAS_STATUS_SUCCESS;
  const mat_t mA = {A, p.ab, (int64_t)p.A.rows, (int64_t)p.A.cols, p.A.ld, p.A.stride};
  const mat_t mB = {B, p.ab, (int64_t)p.B.rows, (int64_t)p.B.cols, p.B.ld, p.B.stride};
  const mat_t mC = {C, cd, p.m, p.n, p.C.ld, p.C.stride};
  const mat_t mD = {D, cd, p.m, p.n, p.D.ld, p.D.stride};
  const bool reads_ab = al != 0.0f && p.k > 0;
  if ((reads_ab &&
       (!check_mat(fn, "A", mA, p.batch, dev) || !check_mat(fn, "B", mB, p.batch, dev))) ||
      (be != 0.0f && !check_mat(fn, "C", mC, p.batch, dev)) ||
      !check_mat(fn, "D", mD, p.batch, dev))
    return CUBLAS_STATUS_INVALID_VALUE;
  epi_t epi = {p.epi, NULL, p.bias_type, NULL, p.aux_type, p.op.aux_ld};
  if (p.biased) { /* m packed values, the same for every batch (no batch stride set) */
    const mat_t bias = {p.op.bias, p.bias_type, p.m, 1, p.m, 0};
    if (!check_mat(fn, "the bias", bias, 1, dev))
      return CUBLAS_STATUS_INVALID_VALUE;
    epi.bias = p.op.bias;
  }
  if (p.epi == EPI_DGELU || p.epi == EPI_GELU_AUX) { /* m x n, ld aux_ld, likewise */
    const mat_t aux = {p.op.aux, p.aux_type, p.m, p.n, p.op.aux_ld, 0};
    if (!check_mat(fn, "the GELU input (aux)", aux, 1, dev))
      return CUBLAS_STATUS_INVALID_VALUE;
    epi.aux = (void *)p.op.aux; /* written by GELU_AUX */
  }
  enqueue(stream, [=] {
    for (int64_t i = 0; i < p.batch; i++) {
      const size_t e = type_bytes(cd);
      const void *Ci = be != 0.0f ? (const char *)C + i * p.C.stride * e : NULL;
      void *Di = (char *)D + i * p.D.stride * e;
      product_or_die(fn, p.m, p.n, p.k, al, mA, p.ta, mB, p.tb, be, Ci, p.C.ld, Di, p.D.ld, cd, epi,
                     i);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */

/* ------------------------------------------------------------------------------------------ */
/* cuda_host.h                                                                                 */
/* ------------------------------------------------------------------------------------------ */

cudaError_t dt_emul_launch_check(const void *func, dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream)
{
  const cudaError_t g = gate();
  if (g != cudaSuccess)
    return fail(g);
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || threads == 0 || threads > 1024 || block.z > 64) {
    report("a launch of grid (%u, %u, %u), block (%u, %u, %u): out of the GPU's limits", grid.x,
           grid.y, grid.z, block.x, block.y, block.z);
    return fail(cudaErrorInvalidConfiguration);
  }
  if (block.y != 1 || block.z != 1) {
    report("a launch of grid (%u, %u, %u), block (%u, %u, %u): the emulation runs 1D blocks only",
           grid.x, grid.y, grid.z, block.x, block.y, block.z);
    return fail(cudaErrorNotSupported);
  }
  int limit;
  {
    std::lock_guard<std::mutex> lock(reg().mu);
    std::unordered_map<const void *, int>::const_iterator it = reg().smem.find(func);
    limit = it == reg().smem.end() ? SMEM_DEFAULT : it->second;
  }
  if (smem > (size_t)limit) {
    report("a launch asks for %zu bytes of dynamic shared memory, its kernel is allowed %d "
           "(cudaFuncSetAttribute raises the limit)",
           smem, limit);
    return fail(cudaErrorInvalidValue);
  }
  if (check_stream("a launch", stream) != cudaSuccess)
    return cudaErrorInvalidResourceHandle;
  if (stream && stream != cudaStreamLegacy && stream != cudaStreamPerThread &&
      stream->device != t_device) {
    report("a launch on a stream of GPU %d while GPU %d is current", stream->device, t_device);
    return fail(cudaErrorInvalidResourceHandle);
  }
  return cudaSuccess;
}

void dt_emul_set_last_error(cudaError_t e)
{
  t_last_error = e;
}

void dt_emul_enqueue(cudaStream_t stream, std::function<void()> work)
{
  enqueue(stream, std::move(work));
}

void dt_emul_enqueue_gate(cudaStream_t stream, std::function<bool()> passed)
{
  enqueue_item(stream, std::move(passed));
}

bool dt_emul_is_device_range(const void *p, size_t bytes)
{
  const uintptr_t u = (uintptr_t)p;
  if (!p || bytes > UINTPTR_MAX - u)
    return false;
  std::lock_guard<std::mutex> lock(reg().mu);
  const alloc_map_t::value_type *a = containing(u);
  return a && u + bytes - a->first <= a->second.bytes;
}

int dt_emul_math_mode_tf32_seen(void)
{
  return g_tf32_seen.load();
}

size_t dt_emul_live_bytes(void)
{
  std::lock_guard<std::mutex> lock(reg().mu);
  size_t total = 0;
  for (int i = 0; i < MAX_GPUS; i++)
    total += reg().live[i];
  return total;
}
