/* device_cpu.c — the CPU device: host memory, 64-byte aligned, and the CPU kernel table. */
#include <string.h>

#include "device.h"
#include "dt_error.h"
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

dt_device_t *dt_device_cpu(void)
{
  static dt_device_t cpu = {.name = "cpu",
                            .comm_backend = "cpu",
                            .host = 1,
                            .alloc = cpu_alloc,
                            .free = cpu_free,
                            .zero = cpu_zero,
                            .copy = cpu_copy,
                            .accumulate = cpu_accumulate,
                            .sync = cpu_sync};
  cpu.ops = dt_ops_cpu();
  return &cpu;
}
