/* residual.cuh — the residual add's kernel (residual.cu launches it, elementwise over a capped
 * grid). Device code only, also compiled for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_RESIDUAL_CUH
#define DT_KERNELS_CUDA_RESIDUAL_CUH

#include "block.cuh"

__global__ static void residual_forward_kernel(float *out, const float *a, const float *b, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    out[i] = a[i] + b[i];
  }
}

#endif
