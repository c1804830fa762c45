/* device.cu — the CUDA device (kernels/device.h): memory, copies, the stream, the cuBLAS and
 * cuBLASLt handles and the kernels' scratch buffers.
 *
 * Invariants:
 * - Two non-blocking streams per device. The compute stream carries the work of the thread that
 *   created the device: every kernel, cuBLAS (bound to it) and its copies. The side stream
 *   carries the copies, zeroes and accumulations of any other thread (the data-parallel comm
 *   thread), so that they neither queue behind the compute thread's later kernels nor race
 *   with them unordered; sync() waits for the calling thread's stream. Events are recorded on
 *   the calling thread's stream.
 * - alloc() returns zeroed memory that is ready when it returns (the memset is waited for), so
 *   memory handed to another stream (NCCL) or read by the host is never seen unzeroed.
 * - copy() to or from the host is complete when it returns (the stream is synchronised): the
 *   host may read the destination, or reuse the source, at once, as with the CPU device.
 *   Device-to-device copies are only ordered on the stream.
 * - free() waits for the stream first, so queued kernels never touch freed memory.
 * - A failed cudaMalloc also sets CUDA's last-error state; it is cleared at once, otherwise the
 *   next kernel's launch check would report the stale out-of-memory error.
 * - Kernels run from the thread that created the device (create() makes its GPU current
 *   there); every entry another thread may call makes it current first (on_stream), so the
 *   comm thread of a rank on GPU 3 never opens a context on GPU 0. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_impl.h"
#include "device.cuh"

extern "C" {
#include "dt_util.h" /* dt_env_switch */
}

/* Makes the device's GPU current on the calling thread and gives that thread's stream: the
 * compute stream on the thread that created the device, the side stream on any other. */
static cudaError_t on_stream(dt_cuda_impl_t *c, cudaStream_t *s)
{
  *s = pthread_equal(pthread_self(), c->owner) ? c->stream : c->side;
  return cudaSetDevice(c->ordinal);
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Allocates bytes of zeroed device memory for `what`; out of memory, the error says what was asked,
 * what is free and `advice` (what the user can change). */
static int gpu_alloc(dt_cuda_impl_t *c, size_t bytes, const char *what, const char *advice,
                     void **out)
{
  void *p = NULL;
  *out = NULL;
  /* Like the CPU device, an empty allocation is still a distinct non-NULL pointer. */
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      (void)cudaGetLastError();
      free_b = total_b = 0;
    }
    const double mib = 1024.0 * 1024.0;
    if (e == cudaErrorMemoryAllocation) {
      DT_ERROR(KERNEL,
               "%s: out of GPU memory for %s: %zu bytes (%.1f MiB) asked, %.1f MiB free of "
               "%.1f MiB; %s",
               c->name, what ? what : "?", bytes, (double)bytes / mib, (double)free_b / mib,
               (double)total_b / mib, advice);
      return DT_ENOMEM;
    }
    DT_ERROR(KERNEL, "%s: cudaMalloc of %zu bytes for %s failed: %s: %s", c->name, bytes,
             what ? what : "?", cudaGetErrorName(e), cudaGetErrorString(e));
    return DT_ECUDA;
  }
  int rc = 0;
  cudaStream_t s;
  DT_CUDA_CHECK_GOTO(on_stream(c, &s), rc, fail);
  DT_CUDA_CHECK_GOTO(cudaMemsetAsync(p, 0, bytes ? bytes : 1, s), rc, fail);
  DT_CUDA_CHECK_GOTO(cudaStreamSynchronize(s), rc, fail);
  *out = p;
  return 0;
fail:
  (void)cudaFree(p);
  return rc;
}

static int cuda_alloc(dt_device_t *d, size_t bytes, const char *what, void **out)
{
  return gpu_alloc(dt__cuda(d), bytes, what,
                   "lower micro_batch, enable activation checkpointing (--recompute), or raise "
                   "the ZeRO stage",
                   out);
}

static void cuda_free(dt_device_t *d, void *p)
{
  dt_cuda_impl_t *c = dt__cuda(d);
  if (!p)
    return;
  cudaStream_t s;
  cudaError_t e = on_stream(c, &s);
  for (cudaStream_t q : {c->stream, c->side}) /* either may still use it */
    if (e == cudaSuccess)
      e = cudaStreamSynchronize(q);
  if (e != cudaSuccess)
    DT_ERROR(KERNEL, "%s: free: waiting for the streams: %s", c->name, cudaGetErrorString(e));
  e = cudaFree(p);
  if (e != cudaSuccess)
    DT_ERROR(KERNEL, "%s: cudaFree: %s", c->name, cudaGetErrorString(e));
}

static int cuda_zero(dt_device_t *d, void *p, size_t bytes)
{
  if (bytes == 0)
    return 0;
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s));
  return 0;
}

/* The CUDA copy kind of a direction; DT_EINVAL for a bad one. */
static int copy_kind(const dt_cuda_impl_t *c, dt_copy_dir_t dir, cudaMemcpyKind *kind)
{
  switch (dir) {
  case DT_COPY_H2D:
    *kind = cudaMemcpyHostToDevice;
    return 0;
  case DT_COPY_D2H:
    *kind = cudaMemcpyDeviceToHost;
    return 0;
  case DT_COPY_D2D:
    *kind = cudaMemcpyDeviceToDevice;
    return 0;
  }
  DT_ERROR(KERNEL, "%s: copy: bad direction %d", c->name, (int)dir);
  return DT_EINVAL;
}

static int cuda_copy(dt_device_t *d, void *dst, const void *src, size_t bytes, dt_copy_dir_t dir)
{
  dt_cuda_impl_t *c = dt__cuda(d);
  cudaMemcpyKind kind;
  DT_CHECK(copy_kind(c, dir, &kind));
  if (bytes == 0 || dst == src)
    return 0;
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(c, &s));
  DT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  if (dir != DT_COPY_D2D)
    DT_CUDA_CHECK(cudaStreamSynchronize(s));
  return 0;
}

static int cuda_copy_2d(dt_device_t *d, void *dst, size_t dpitch, const void *src, size_t spitch,
                        size_t width, size_t rows, dt_copy_dir_t dir)
{
  dt_cuda_impl_t *c = dt__cuda(d);
  cudaMemcpyKind kind;
  DT_CHECK(copy_kind(c, dir, &kind));
  if (width == 0 || rows == 0)
    return 0;
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(c, &s));
  DT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind, s));
  if (dir != DT_COPY_D2D)
    DT_CUDA_CHECK(cudaStreamSynchronize(s));
  return 0;
}

static int cuda_accumulate(dt_device_t *d, float *dst, const float *src, size_t n)
{
  if (n == 0)
    return 0;
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  accumulate_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, s>>>(dst, src, n);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

static int cuda_sync(dt_device_t *d)
{
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaStreamSynchronize(s));
  return 0;
}

/* Events: cudaEvent_t on the calling thread's stream; without timing (record and wait only),
 * except the timed ones of profiles (recording those costs a little more). */
static int event_create(dt_device_t *d, unsigned flags, void **out)
{
  cudaEvent_t e;
  cudaStream_t s;
  *out = NULL;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
  *out = e;
  return 0;
}

static int cuda_event_create(dt_device_t *d, void **out)
{
  return event_create(d, cudaEventDisableTiming, out);
}

static int cuda_timed_event_create(dt_device_t *d, void **out)
{
  return event_create(d, cudaEventDefault, out);
}

static int cuda_event_ms(dt_device_t *d, void *from, void *to, double *ms)
{
  cudaStream_t s;
  float f = 0.0f;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaEventElapsedTime(&f, (cudaEvent_t)from, (cudaEvent_t)to));
  *ms = f;
  return 0;
}

static void cuda_event_destroy(dt_device_t *d, void *ev)
{
  if (!ev)
    return;
  cudaStream_t s;
  cudaError_t e = on_stream(dt__cuda(d), &s);
  if (e == cudaSuccess)
    e = cudaEventDestroy((cudaEvent_t)ev);
  if (e != cudaSuccess)
    DT_ERROR(KERNEL, "%s: cudaEventDestroy: %s", dt__cuda(d)->name, cudaGetErrorString(e));
}

static int cuda_event_record(dt_device_t *d, void *ev)
{
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaEventRecord((cudaEvent_t)ev, s));
  return 0;
}

static int cuda_event_wait(dt_device_t *d, void *ev)
{
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)ev));
  return 0;
}

static int cuda_memory(dt_device_t *d, size_t *used, size_t *total)
{
  size_t free_bytes = 0;
  cudaStream_t s;
  DT_CUDA_CHECK(on_stream(dt__cuda(d), &s));
  DT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, total));
  *used = *total - free_bytes;
  return 0;
}

static size_t cuda_own_bytes(dt_device_t *d, char *what, size_t whatlen)
{
  const dt_cuda_impl_t *c = dt__cuda(d);
  const double MiB = 1024.0 * 1024.0;
  const size_t scratch = c->ws_bytes + c->stage_bytes + c->ones_n * sizeof(float);
  snprintf(what, whatlen, "cuBLASLt's workspace %.1f MiB + kernel scratch %.1f MiB",
           c->lt_ws_bytes / MiB, scratch / MiB);
  return c->lt_ws_bytes + scratch;
}

/* Device memory of this GPU (from alloc, or from anyone's cudaMalloc on it); host memory, other
 * GPUs' memory and NULL are not. A pointer CUDA does not know is not an error: the failed query
 * is cleared from CUDA's last-error state. */
static int cuda_owns(dt_device_t *d, const void *p)
{
  if (!p)
    return 0;
  cudaPointerAttributes a;
  cudaStream_t s;
  if (on_stream(dt__cuda(d), &s) != cudaSuccess || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeDevice && a.device == dt__cuda(d)->ordinal;
}

/* ------------------------------------------------------------------------------------------ */
/* Scratch: the workspace, the staging and the ones vector                                    */
/* ------------------------------------------------------------------------------------------ */

/* Replaces *buf by a zeroed buffer of at least `want` bytes if it is smaller. Rounded up to
 * 1 MiB so that slowly growing requests do not reallocate every time. */
static int grow(dt_cuda_impl_t *c, void **buf, size_t *have, size_t want, const char *what)
{
  const size_t granule = (size_t)1 << 20;
  if (want <= *have && *buf)
    return 0;
  if (*buf) {
    /* Kernels queued earlier may still read the old buffer. */
    DT_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    DT_CUDA_CHECK(cudaFree(*buf));
    *buf = NULL;
    *have = 0;
  }
  size_t bytes = (want + granule - 1) / granule * granule;
  if (bytes == 0)
    bytes = granule;
  int rc = cuda_alloc(&c->dev, bytes, what, buf);
  if (rc < 0)
    return rc;
  *have = bytes;
  return 0;
}

int dt__cuda_workspace(dt_cuda_impl_t *c, size_t bytes, void **out)
{
  int rc = grow(c, &c->ws, &c->ws_bytes, bytes, "the CUDA kernels' workspace");
  *out = rc < 0 ? NULL : c->ws;
  return rc;
}

int dt__cuda_stage(dt_cuda_impl_t *c, size_t bytes, void **out)
{
  int rc = grow(c, &c->stage, &c->stage_bytes, bytes, "the bf16 outputs' fp32 staging");
  *out = rc < 0 ? NULL : c->stage;
  return rc;
}

int dt__cuda_ones(dt_cuda_impl_t *c, size_t n, const float **out)
{
  *out = NULL;
  if (n > c->ones_n || !c->ones) {
    size_t bytes = 0;
    void *buf = c->ones;
    int rc = grow(c, &buf, &bytes, n * sizeof(float), "the CUDA kernels' ones vector");
    c->ones = (float *)buf;
    c->ones_n = 0;
    if (rc < 0)
      return rc;
    size_t len = bytes / sizeof(float);
    fill_kernel<<<dt__cuda_grid(len, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, c->stream>>>(
        c->ones, 1.0f, len);
    DT_CUDA_CHECK(cudaGetLastError());
    c->ones_n = len;
  }
  *out = c->ones;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Create / destroy                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* Releases whatever create() got before it failed, or everything at destroy. */
static void impl_free(dt_cuda_impl_t *c)
{
  for (cudaStream_t s : {c->stream, c->side})
    if (s) {
      cudaError_t e = cudaStreamSynchronize(s);
      if (e != cudaSuccess)
        DT_ERROR(KERNEL, "%s: destroy: waiting for a stream: %s", c->name, cudaGetErrorString(e));
    }
  if (c->ws)
    (void)cudaFree(c->ws);
  if (c->stage)
    (void)cudaFree(c->stage);
  if (c->ones)
    (void)cudaFree(c->ones);
  if (c->pin)
    (void)cudaFreeHost(c->pin);
  if (c->pin_copied)
    (void)cudaEventDestroy(c->pin_copied);
  if (c->lt_ws)
    (void)cudaFree(c->lt_ws);
  if (c->lt)
    (void)cublasLtDestroy(c->lt);
  if (c->blas)
    (void)cublasDestroy(c->blas);
  if (c->side)
    (void)cudaStreamDestroy(c->side);
  if (c->stream)
    (void)cudaStreamDestroy(c->stream);
  free(c);
}

extern "C" int dt_device_cuda_create(int ordinal, dt_device_t **out)
{
  int rc = 0;
  *out = NULL;
  dt_cuda_impl_t *c = (dt_cuda_impl_t *)calloc(1, sizeof *c);
  if (!c) {
    DT_ERROR(KERNEL, "cuda:%d: out of host memory for the device", ordinal);
    return DT_ENOMEM;
  }
  c->dev.impl = c;
  c->ordinal = ordinal;
  c->owner = pthread_self();
  snprintf(c->name, sizeof c->name, "cuda:%d", ordinal);
  DT_CUDA_CHECK_GOTO(cudaSetDevice(ordinal), rc, fail);
  DT_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), rc, fail);
  DT_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasCreate(&c->blas), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasSetStream(c->blas, c->stream), rc, fail);
  /* Plain fp32 arithmetic: no TF32 tensor cores and no BF16x9 emulation, so that GEMMs agree
   * with the CPU reference to fp32 rounding. */
  DT_CUBLAS_CHECK_GOTO(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH), rc, fail);
  c->use_lt = 1;
  c->stage_max = DT__CUDA_STAGE_MAX;
  DT_CHECK_GOTO(dt_env_switch("DISTRAIN_CUDA_CUBLASLT", &c->use_lt), rc, fail);
  DT_CHECK_GOTO(dt_env_switch("DISTRAIN_CUDA_GEMM_TUNE", &c->lt_tune), rc, fail);
  DT_CHECK_GOTO(dt_env_switch("DISTRAIN_CUDA_WGMMA", &c->wgmma), rc, fail);
  DT_CUBLAS_CHECK_GOTO(cublasLtCreate(&c->lt), rc, fail);
  {
    /* cuBLAS's advice for cuBLASLt's workspace: 32 MiB on Hopper and later, 4 MiB before. */
    int major = 0;
    DT_CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal),
                       rc, fail);
    c->lt_ws_bytes = (size_t)(major >= 9 ? 32 : 4) << 20;
    int minor = 0;
    DT_CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal),
                       rc, fail);
    if (c->wgmma && (major != 9 || minor != 0)) { /* its kernel is sm_90a code */
      DT_ERROR(KERNEL,
               "%s: DISTRAIN_CUDA_WGMMA=1 needs a GPU of compute capability 9.0 (H100, H200); "
               "this one is %d.%d: unset it",
               c->name, major, minor);
      rc = DT_EINVAL;
      goto fail;
    }
    int optin = 0;
    DT_CUDA_CHECK_GOTO(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal), rc, fail);
    c->smem_optin = (size_t)optin;
    c->ce_keep_max = c->smem_optin / 2;
    rc = gpu_alloc(c, c->lt_ws_bytes, "cuBLASLt's workspace",
                   "the GPU is full before training starts: another process may hold its memory "
                   "(nvidia-smi)",
                   &c->lt_ws);
    if (rc < 0)
      goto fail;
  }

  c->dev.name = c->name;
  c->dev.comm_backend = "nccl";
  c->dev.ops = dt_ops_cuda();
  c->dev.host = 0;
  c->dev.alloc = cuda_alloc;
  c->dev.free = cuda_free;
  c->dev.zero = cuda_zero;
  c->dev.copy = cuda_copy;
  c->dev.copy_2d = cuda_copy_2d;
  c->dev.accumulate = cuda_accumulate;
  c->dev.sync = cuda_sync;
  c->dev.event_create = cuda_event_create;
  c->dev.event_destroy = cuda_event_destroy;
  c->dev.event_record = cuda_event_record;
  c->dev.event_wait = cuda_event_wait;
  c->dev.timed_event_create = cuda_timed_event_create;
  c->dev.event_ms = cuda_event_ms;
  c->dev.owns = cuda_owns;
  c->dev.memory = cuda_memory;
  c->dev.own_bytes = cuda_own_bytes;
  *out = &c->dev;
  return 0;
fail:
  impl_free(c);
  return rc;
}

extern "C" void dt_device_cuda_destroy(dt_device_t *d)
{
  if (!d)
    return;
  impl_free(dt__cuda(d));
}
