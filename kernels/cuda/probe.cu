/* probe.cu — how many CUDA GPUs this process sees, treating "no GPU here" as zero. Its own
 * library (dt_cuda_probe, the CUDA runtime only), so the agent can count GPUs without loading
 * cuBLAS and the kernels. */
#include <cuda_runtime.h>

#include "cuda_kernels.h"
#include "dt_error.h"

extern "C" int dt_cuda_device_count(int *count)
{
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
    *count = 0;
    return 0;
  }
  if (e != cudaSuccess) {
    *count = 0;
    return DT_ECUDA;
  }
  *count = n;
  return 0;
}
