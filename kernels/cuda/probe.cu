/* probe.cu — see probe.h. Only the runtime's property queries: cudaGetDeviceProperties for the
 * name and memory (the runtime has no attribute for either; the driver API's cuDeviceGetName
 * would link libcuda, absent on CPU machines) and cudaDeviceGetPCIBusId, neither of which makes
 * the device's primary context. */
#include <cuda_runtime.h>

#include <stdio.h>
#include <string.h>

#include "cuda_check.h"
#include "probe.h"

extern "C" {
#include "cuda_version.h"
}

extern "C" int dt_cuda_probe(int *count, char *why, size_t len)
{
  int n = 0, driver = 0, runtime = 0;
  if (why && len)
    why[0] = '\0';
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) {
    *count = n;
    return 0;
  }
  cudaGetLastError(); /* a failed count is not sticky: clear it so later calls start clean */
  if (e == cudaErrorNoDevice)
    return 0;
  cudaDriverGetVersion(&driver); /* 0 when no driver is installed */
  cudaRuntimeGetVersion(&runtime);
  if (e == cudaErrorInsufficientDriver && driver == 0)
    return 0; /* no NVIDIA driver: a CPU machine */
  if (dt_cuda_driver_older(driver, runtime)) {
    if (why && len)
      dt_cuda_mismatch_message(driver, runtime, why, len);
    return 0;
  }
  if (why && len) {
    char d[16], r[16];
    dt_cuda_version_str(driver, d, sizeof d);
    dt_cuda_version_str(runtime, r, sizeof r);
    snprintf(why, len, "cudaGetDeviceCount failed: %s: %s (driver supports CUDA %s, runtime %s)",
             cudaGetErrorName(e), cudaGetErrorString(e), d, r);
  }
  return e == cudaErrorInsufficientDriver ? 0 : DT_ECUDA;
}

extern "C" int dt_cuda_device_count(int *count)
{
  return dt_cuda_probe(count, NULL, 0);
}

extern "C" int dt_cuda_gpu_info(int ordinal, dt_cuda_gpu_t *out)
{
  memset(out, 0, sizeof *out);
  cudaDeviceProp prop;
  DT_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  DT_CUDA_CHECK(cudaDeviceGetPCIBusId(out->pci_bus_id, (int)sizeof out->pci_bus_id, ordinal));
  snprintf(out->name, sizeof out->name, "%s", prop.name);
  out->memory_bytes = (uint64_t)prop.totalGlobalMem;
  return 0;
}
