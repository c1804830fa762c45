/* device.cu — CUDA device discovery that treats "no GPU here" as zero devices. */
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
