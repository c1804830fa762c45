/* device.h — the device a trainer's tensors live on and its kernels run on.
 *
 * Model, ZeRO and pipeline code never touch tensor memory themselves: they allocate, zero,
 * copy and accumulate through their dt_device_t and compute through its kernel table, so the
 * CPU and CUDA backends differ only in their device and their kernels. Host code may read or
 * write tensor memory directly only where the device says it is host memory (`host`): the CPU
 * device is; a GPU device goes through copy() with a host buffer.
 *
 * Every entry returns 0 or a negative DT_E* code (a GPU call can fail), except free. Kernels run
 * on the thread that created the device; copy, zero, accumulate, sync and the events may also be
 * called from one other thread (the data-parallel comm thread). Each thread's work is ordered
 * on its own stream (a GPU device's compute stream, and a side stream for the other thread), and
 * sync() waits for the calling thread's; results that the host reads after a D2H copy are
 * complete when copy() returns. An event marks a point of the compute stream, so that the other
 * thread can wait for the work queued up to it and no more; the compute thread sees the other
 * thread's results once that thread has synced and said so. */
#ifndef DT_KERNELS_DEVICE_H
#define DT_KERNELS_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef enum {
  DT_COPY_H2D = 0, /* host to device */
  DT_COPY_D2H = 1, /* device to host */
  DT_COPY_D2D = 2, /* within the device */
} dt_copy_dir_t;

typedef struct dt_device {
  const char *name;         /* "cpu", "cuda:0" */
  const char *comm_backend; /* the dt_comm backend that moves this device's memory */
  const dt_ops_t *ops;      /* its kernel table */
  int host;                 /* its memory is host memory (the host may use it directly) */
  /* bytes of zeroed memory, aligned for the kernels; what names it in an out-of-memory error */
  int (*alloc)(struct dt_device *d, size_t bytes, const char *what, void **out);
  void (*free)(struct dt_device *d, void *p); /* NULL is fine */
  int (*zero)(struct dt_device *d, void *p, size_t bytes);
  int (*copy)(struct dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_dir_t dir);
  /* rows pieces of width bytes, the i-th from src + i spitch to dst + i dpitch (one call for a
   * strided gather or scatter, as cudaMemcpy2D); the pieces must not overlap */
  int (*copy_2d)(struct dt_device *d, void *dst, size_t dpitch, const void *src, size_t spitch,
                 size_t width, size_t rows, dt_copy_dir_t dir);
  /* dst += src, n floats */
  int (*accumulate)(struct dt_device *d, float *dst, const float *src, size_t n);
  int (*sync)(struct dt_device *d);
  /* Events. event_record marks the work the calling thread queued so far;
   * event_wait blocks the calling thread until that work is done. It waits for less than
   * sync(), which also takes whatever was queued after the mark: the data-parallel comm thread
   * waits so for the kernels that produced (or last read) the buffers of its task, while the
   * compute thread queues the next layers. Record an event again only when no thread waits on
   * it. Host devices finish every call before it returns: their events are no-ops (and may be
   * NULL). */
  int (*event_create)(struct dt_device *d, void **out);
  void (*event_destroy)(struct dt_device *d, void *ev); /* NULL is fine */
  int (*event_record)(struct dt_device *d, void *ev);
  int (*event_wait)(struct dt_device *d, void *ev);
  /* Timing (profiles: worker/trainer/profile.h). timed_event_create makes an event that
   * event_ms can time (record, wait for and destroy it as any other); event_ms gives the
   * milliseconds between the moments the device finished the work two recorded events mark,
   * once both are done: after sync() or an event_wait on the later (an error before).
   * NULL on host devices, whose calls are done when they return: the host clock times them. */
  int (*timed_event_create)(struct dt_device *d, void **out);
  int (*event_ms)(struct dt_device *d, void *from, void *to, double *ms);
  /* p points into memory this device allocated (a communicator stages such buffers) */
  int (*owns)(struct dt_device *d, const void *p);
  /* Device memory in use (by every process on the device, the CUDA context included: what
   * nvidia-smi shows) and in total, in bytes; NULL on devices of host memory. */
  int (*memory)(struct dt_device *d, size_t *used, size_t *total);
  /* Device memory the device holds for itself, which no tensor the trainer counts includes
   * (a GPU's: cuBLASLt's workspace and the kernels' scratch, which grows to the largest call's
   * need in the first step): bytes, and their breakdown in `what` ("cuBLASLt's workspace 32.0
   * MiB + kernel scratch 3.0 MiB"). NULL on devices of host memory. */
  size_t (*own_bytes)(struct dt_device *d, char *what, size_t whatlen);
  void *impl;
} dt_device_t;

/* The CPU device (host memory, the OpenBLAS kernels, the "cpu" comm backend). */
dt_device_t *dt_device_cpu(void);

/* The CPU kernels on memory the host must treat as a GPU's: host = 0, and the pointers it hands
 * out lie outside the canonical address range (real address + DT_DEVICE_REMOTE_OFFSET), so
 * any direct host access faults at once, while its copies and kernels translate them back.
 * It runs the code paths of a GPU trainer (staged inputs and losses, device-to-host
 * checkpoint reads, host-staged communication) on machines without a GPU: the CPU tests use
 * it to prove those paths neither touch device memory nor change a result. */
dt_device_t *dt_device_cpu_remote(void);

#define DT_DEVICE_REMOTE_OFFSET ((unsigned long long)1 << 47)

/* The host address behind a pointer of a CPU device: p itself on the CPU device (and for
 * NULL), p - DT_DEVICE_REMOTE_OFFSET on the remote one. What the CPU kernel table calls its
 * kernels with; only the two CPU devices run that table. */
static inline void *dt_device_host_ptr(const struct dt_device *d, const void *p)
{
  if (!p || !d || d->host)
    return (void *)p;
  return (void *)((uintptr_t)p - DT_DEVICE_REMOTE_OFFSET);
}

#endif
