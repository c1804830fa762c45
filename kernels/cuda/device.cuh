/* device.cuh — the device object's own kernels (device.cu launches them, elementwise over a
 * capped grid): the accumulate of the ZeRO reductions and the ones vector's fill. Also compiled
 * for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_DEVICE_CUH
#define DT_KERNELS_CUDA_DEVICE_CUH

#include "block.cuh"

__global__ static void accumulate_kernel(float *dst, const float *src, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    dst[i] += src[i];
  }
}

__global__ static void fill_kernel(float *x, float value, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    x[i] = value;
  }
}

#endif
