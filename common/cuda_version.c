/* cuda_version.c — see cuda_version.h. */
#include "cuda_version.h"

#include <stdio.h>

void dt_cuda_version_str(int version, char *buf, size_t n)
{
  snprintf(buf, n, "%d.%d", version / 1000, version % 1000 / 10);
}

int dt_cuda_driver_older(int driver, int runtime)
{
  return driver > 0 && driver < runtime;
}

void dt_cuda_mismatch_message(int driver, int runtime, char *buf, size_t n)
{
  char d[16], r[16];
  dt_cuda_version_str(driver, d, sizeof d);
  dt_cuda_version_str(runtime, r, sizeof r);
  snprintf(buf, n,
           "CUDA driver supports up to %s, the runtime is %s: update the NVIDIA driver or use a "
           "CUDA %s build",
           d, r, d);
}
