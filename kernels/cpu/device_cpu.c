/* device_cpu.c — the CPU devices: host memory, 64-byte aligned, and the CPU kernel table; the
 * remote one hands out translated pointers (device.h) so the host cannot use them directly. */
#include <string.h>

#include "device.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"

static int cpu_alloc(dt_device_t *d, size_t bytes, const char *what, void **out)
{
  (void)d;
  *out = dt_calloc_aligned(bytes ? bytes : 1, what);
  return *out ? 0 : DT_ENOMEM;
}

static void cpu_free(dt_device_t *d, void *p)
{
  (void)d;
  dt_free_aligned(p);
}

static int cpu_zero(dt_device_t *d, void *p, size_t bytes)
{
  (void)d;
  memset(p, 0, bytes);
  return 0;
}

static int cpu_copy(dt_device_t *d, void *dst, const void *src, size_t bytes, dt_copy_dir_t dir)
{
  (void)d;
  (void)dir;
  if (dst != src)
    memmove(dst, src, bytes);
  return 0;
}

static int cpu_copy_2d(dt_device_t *d, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t rows, dt_copy_dir_t dir)
{
  (void)d;
  (void)dir;
  for (size_t i = 0; i < rows; i++)
    memcpy((char *)dst + i * dpitch, (const char *)src + i * spitch, width);
  return 0;
}

static int cpu_accumulate(dt_device_t *d, float *dst, const float *src, size_t n)
{
  (void)d;
  for (size_t i = 0; i < n; i++)
    dst[i] += src[i];
  return 0;
}

static int cpu_sync(dt_device_t *d)
{
  (void)d;
  return 0;
}

/* Host work is done when its call returns: an event has nothing to mark or wait for. */
static int cpu_event_create(dt_device_t *d, void **out)
{
  (void)d;
  *out = NULL;
  return 0;
}

static void cpu_event_destroy(dt_device_t *d, void *ev)
{
  (void)d;
  (void)ev;
}

static int cpu_event_noop(dt_device_t *d, void *ev)
{
  (void)d;
  (void)ev;
  return 0;
}

static int cpu_owns(dt_device_t *d, const void *p)
{
  (void)d;
  (void)p;
  return 1;
}

/* The remote device: the same operations on translated pointers. */
#define H(p) dt_device_host_ptr(d, (p))

static int remote_alloc(dt_device_t *d, size_t bytes, const char *what, void **out)
{
  void *p;
  DT_CHECK(cpu_alloc(d, bytes, what, &p));
  *out = (void *)((uintptr_t)p + DT_DEVICE_REMOTE_OFFSET);
  return 0;
}

static void remote_free(dt_device_t *d, void *p)
{
  cpu_free(d, H(p));
}

static int remote_zero(dt_device_t *d, void *p, size_t bytes)
{
  return cpu_zero(d, H(p), bytes);
}

static int remote_copy(dt_device_t *d, void *dst, const void *src, size_t bytes, dt_copy_dir_t dir)
{
  void *to = dir == DT_COPY_D2H ? dst : H(dst);
  const void *from = dir == DT_COPY_H2D ? src : H(src);
  return cpu_copy(d, to, from, bytes, dir);
}

static int remote_copy_2d(dt_device_t *d, void *dst, size_t dpitch, const void *src, size_t spitch,
                          size_t width, size_t rows, dt_copy_dir_t dir)
{
  void *to = dir == DT_COPY_D2H ? dst : H(dst);
  const void *from = dir == DT_COPY_H2D ? src : H(src);
  return cpu_copy_2d(d, to, dpitch, from, spitch, width, rows, dir);
}

static int remote_accumulate(dt_device_t *d, float *dst, const float *src, size_t n)
{
  return cpu_accumulate(d, H(dst), H(src), n);
}

static int remote_owns(dt_device_t *d, const void *p)
{
  (void)d;
  return (uintptr_t)p >= DT_DEVICE_REMOTE_OFFSET;
}

dt_device_t *dt_device_cpu(void)
{
  static dt_device_t cpu = {.name = "cpu",
                            .comm_backend = "cpu",
                            .host = 1,
                            .alloc = cpu_alloc,
                            .free = cpu_free,
                            .zero = cpu_zero,
                            .copy = cpu_copy,
                            .copy_2d = cpu_copy_2d,
                            .accumulate = cpu_accumulate,
                            .sync = cpu_sync,
                            .event_create = cpu_event_create,
                            .event_destroy = cpu_event_destroy,
                            .event_record = cpu_event_noop,
                            .event_wait = cpu_event_noop,
                            .owns = cpu_owns};
  cpu.ops = dt_ops_cpu();
  return &cpu;
}

dt_device_t *dt_device_cpu_remote(void)
{
  static dt_device_t remote = {.name = "cpu-remote",
                               .comm_backend = "cpu",
                               .host = 0,
                               .alloc = remote_alloc,
                               .free = remote_free,
                               .zero = remote_zero,
                               .copy = remote_copy,
                               .copy_2d = remote_copy_2d,
                               .accumulate = remote_accumulate,
                               .sync = cpu_sync,
                               .event_create = cpu_event_create,
                               .event_destroy = cpu_event_destroy,
                               .event_record = cpu_event_noop,
                               .event_wait = cpu_event_noop,
                               .owns = remote_owns};
  remote.ops = dt_ops_cpu();
  return &remote;
}
