/* norm.cuh — the sum-of-squares kernels (norm.cu launches them on a grid that n alone sets,
 * ss_blocks(n), then one block; its top comment says why). Device code only, also compiled for
 * the host by tests/emul/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_NORM_CUH
#define DT_KERNELS_CUDA_NORM_CUH

#include "block.cuh"

#define SS_BLOCKS  1024 /* at most: the reduction order must not depend on the GPU */
#define SS_THREADS 256
#define SS_ELEMS   16 /* per thread at least, below SS_BLOCKS blocks */

/* The first pass's blocks for n values: a function of n only (the order of the sums with it). */
static inline unsigned ss_blocks(size_t n)
{
  const size_t per_block = (size_t)SS_THREADS * SS_ELEMS, b = (n + per_block - 1) / per_block;
  return (unsigned)(b < 1 ? 1 : b > SS_BLOCKS ? SS_BLOCKS : b);
}

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
