/* norm.cuh — the sum-of-squares kernels (norm.cu launches them on a fixed grid of SS_BLOCKS
 * blocks, then one block; its top comment says why the grid is fixed). Device code only, also
 * compiled for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_NORM_CUH
#define DT_KERNELS_CUDA_NORM_CUH

#include "block.cuh"

#define SS_BLOCKS  1024 /* fixed: the reduction order must not depend on the GPU */
#define SS_THREADS 256

__global__ static void sumsq_partial_kernel(double *partial, const float *x, size_t n)
{
  double acc = 0.0;
  DT__CUDA_FOR(i, n)
  {
    const double v = (double)x[i];
    acc += v * v;
  }
  acc = dt__block_reduce(acc, dt__sum_op());
  if (threadIdx.x == 0)
    partial[blockIdx.x] = acc;
}

__global__ static void sumsq_final_kernel(double *result, const double *partial, int npartial)
{
  double acc = 0.0;
  for (int i = threadIdx.x; i < npartial; i += blockDim.x)
    acc += partial[i];
  acc = dt__block_reduce(acc, dt__sum_op());
  if (threadIdx.x == 0)
    *result = acc;
}

#endif
