/* devices.c — the trainer's device choice (devices.h). */
#include "devices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"
#ifdef DT_HAVE_CUDA
#include "cuda_kernels.h"
#endif

#ifdef DT_HAVE_CUDA
/* A non-negative integer variable; -1 when absent or malformed. */
static int env_index(const char *name)
{
  const char *s = getenv(name);
  char *end;
  long v = s ? strtol(s, &end, 10) : -1;
  return s && *s && *end == '\0' && v >= 0 && v < 1 << 20 ? (int)v : -1;
}
#endif

/* GPUs visible to this process (0 without a driver or without CUDA support in this build).
 * why: empty, or why a driver that is present cannot be used (its version and the runtime's). */
static int gpu_count(char *why, size_t len)
{
  int n = 0;
  why[0] = '\0';
#ifdef DT_HAVE_CUDA
  if (dt_cuda_probe(&n, why, len) != 0)
    n = 0;
#endif
  return n;
}

static int open_cuda(dt_device_t **out)
{
#ifdef DT_HAVE_CUDA
  char why[512];
  const int n = gpu_count(why, sizeof why), lr = DT_MAX(0, env_index("LOCAL_RANK"));
  const int given = env_index("DISTRAIN_CUDA_DEVICE"); /* the agent's choice */
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (n == 0 && why[0]) {
    DT_ERROR(TRAIN, "--device cuda: %s", why);
    return DT_ENOTSUP;
  }
  if (n == 0) {
    DT_ERROR(TRAIN,
             "--device cuda: no usable CUDA GPU (CUDA_VISIBLE_DEVICES=%s); check nvidia-smi, or "
             "train on --device cpu",
             visible ? visible : "(unset)");
    return DT_ENOTSUP;
  }
  if (given >= n) {
    DT_ERROR(
        TRAIN,
        "--device cuda: DISTRAIN_CUDA_DEVICE=%d, but %d GPU%s visible (CUDA_VISIBLE_DEVICES=%s)",
        given, n, n == 1 ? " is" : "s are", visible ? visible : "(unset)");
    return DT_EINVAL;
  }
  const int ordinal = given >= 0 ? given : lr % n; /* given: the agent's GPU for this device */
  if (given < 0 && lr >= n)
    DT_INFO(TRAIN, "LOCAL_RANK %d with %d visible GPU%s: sharing GPU %d", lr, n, n == 1 ? "" : "s",
            ordinal);
  dt_cuda_gpu_t gpu;
  if (dt_cuda_gpu_info(ordinal, &gpu) == 0)
    DT_INFO(TRAIN, "GPU %d of %d visible (CUDA_VISIBLE_DEVICES=%s): %s, %.1f GiB, PCI %s", ordinal,
            n, visible ? visible : "(unset)", gpu.name, (double)gpu.memory_bytes / (1 << 30),
            gpu.pci_bus_id);
  return dt_device_cuda_create(ordinal, out);
#else
  (void)out;
  DT_ERROR(TRAIN,
           "--device cuda: this distrain-train was built without CUDA (no nvcc found at "
           "configure time); rebuild on a machine with the CUDA toolkit, or use --device cpu");
  return DT_ENOTSUP;
#endif
}

int dt_train_device_open(const char *want, dt_device_t **out)
{
  *out = NULL;
  if (!want || strcmp(want, "auto") == 0) {
    char why[512];
    if (gpu_count(why, sizeof why) > 0)
      return open_cuda(out);
    if (why[0])
      DT_WARN(TRAIN, "--device auto: %s; training on the CPU", why);
    else
      DT_DEBUG(TRAIN, "--device auto: no CUDA GPU here, training on the CPU");
    *out = dt_device_cpu();
    return 0;
  }
  if (strcmp(want, "cpu") == 0) {
    *out = dt_device_cpu();
    return 0;
  }
  if (strcmp(want, "cpu-remote") == 0) {
    *out = dt_device_cpu_remote();
    return 0;
  }
  if (strcmp(want, "cuda") == 0)
    return open_cuda(out);
  DT_ERROR(TRAIN, "--device %s: expected cpu, cuda or auto", want);
  return DT_EINVAL;
}

int dt_train_device_comm_able(const dt_device_t *dev, uint64_t *gpu_id, char *why, size_t len)
{
  *gpu_id = 0;
  if (dev->host || !dev->comm_backend || strcmp(dev->comm_backend, "cpu") == 0) {
    snprintf(why, len, "--device %s is not a GPU", dev->name);
    return 0;
  }
  if (!dt_comm_has_backend(dev->comm_backend)) {
    snprintf(why, len, "this build has no %s backend (it was not found at configure time)",
             dev->comm_backend);
    return 0;
  }
#ifdef DT_HAVE_CUDA
  int ordinal;
  dt_cuda_gpu_t gpu;
  char host[256] = "";
  if (sscanf(dev->name, "cuda:%d", &ordinal) != 1 || dt_cuda_gpu_info(ordinal, &gpu) != 0) {
    snprintf(why, len, "the PCI address of %s is unknown", dev->name);
    return 0;
  }
  (void)gethostname(host, sizeof host - 1);
  uint64_t h = DT_FNV1A_INIT; /* over "host/pci" */
  for (const char *parts[] = {host, "/", gpu.pci_bus_id}, **p = parts; p < parts + 3; p++)
    h = dt_fnv1a(h, *p, strlen(*p));
  *gpu_id = h;
  return 1;
#else
  snprintf(why, len, "this build has no CUDA");
  return 0;
#endif
}

double dt_gpu_peak_bf16_flops(const char *name)
{
  /* the first entry whose text the name contains: the PCIe and NVL boards before the SXM one */
  static const struct {
    const char *part;
    double tflops;
  } peaks[] = {{"H100 PCIe", 756.0}, {"H100 NVL", 835.0}, {"H200 NVL", 835.0}, {"GH200", 989.0},
               {"H100", 989.0},      {"H200", 989.0},     {"A100", 312.0}};
  for (size_t i = 0; name && i < sizeof peaks / sizeof *peaks; i++)
    if (strstr(name, peaks[i].part))
      return peaks[i].tflops * 1e12;
  return 0.0;
}

double dt_train_device_peak_bf16_flops(const dt_device_t *dev, char *name, size_t n)
{
  snprintf(name, n, "%s", "");
#ifdef DT_HAVE_CUDA
  int ordinal;
  dt_cuda_gpu_t gpu;
  if (!dev->host && sscanf(dev->name, "cuda:%d", &ordinal) == 1 &&
      dt_cuda_gpu_info(ordinal, &gpu) == 0) {
    snprintf(name, n, "%s", gpu.name);
    return dt_gpu_peak_bf16_flops(gpu.name);
  }
#else
  (void)dev;
#endif
  return 0.0;
}

void dt_train_device_close(dt_device_t *dev)
{
#ifdef DT_HAVE_CUDA
  if (dev && dev != dt_device_cpu() && dev != dt_device_cpu_remote())
    dt_device_cuda_destroy(dev);
#else
  (void)dev;
#endif
}
