/* block.cuh — device code every CUDA kernel file shares: launch geometry, grid-stride loops,
 * deterministic block reductions and the store of an output element in fp32 or bf16.
 * Header-only and free of the CUDA runtime API, so that tests/unit/cuda_emul.h (which provides
 * __nv_bfloat16 there) can compile it, and the kernels built on it, for the host. */
#ifndef DT_KERNELS_CUDA_BLOCK_CUH
#define DT_KERNELS_CUDA_BLOCK_CUH

#include <stddef.h>
#ifdef __CUDACC__
#include <cuda_bf16.h>
#endif

#define DT__CUDA_THREADS  256    /* elementwise kernels */
#define DT__CUDA_MAX_GRID 65536u /* grid-stride loops cover the rest */

/* Blocks for n elements at `threads` per block, at least 1, at most DT__CUDA_MAX_GRID. */
static inline unsigned dt__cuda_grid(size_t n, unsigned threads)
{
  size_t blocks = (n + threads - 1) / threads;
  if (blocks == 0)
    blocks = 1;
  return blocks > DT__CUDA_MAX_GRID ? DT__CUDA_MAX_GRID : (unsigned)blocks;
}

/* An output element: fp32, or rounded to bf16 (to nearest even) for a bf16 activation (ops.h).
 * Kernels templated on their output type write through it. */
__device__ static inline void dt__store(float *o, float v)
{
  *o = v;
}

__device__ static inline void dt__store(__nv_bfloat16 *o, float v)
{
  *o = __float2bfloat16_rn(v);
}

/* Grid-stride loop over [0, n) with a size_t index. */
#define DT__CUDA_FOR(i, n)                                                                         \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                          \
       i += (size_t)gridDim.x * blockDim.x)

struct dt__sum_op {
  template <typename T> __device__ T operator()(T a, T b) const
  {
    return a + b;
  }
};
/* The CPU references' "x > m ? x : m" */
struct dt__max_op {
  template <typename T> __device__ T operator()(T a, T b) const
  {
    return b > a ? b : a;
  }
};

/* Combines one value per thread over the whole block; every thread returns the result.
 * blockDim.x must be a multiple of 32 (at most 1024) and every thread of the block must call it
 * (it synchronises). Each warp folds its 32 values with shuffles, then every thread folds the
 * warps' results in warp order: the order is fixed by the block size, hence deterministic.
 * Consecutive calls may reuse the shared array: the first barrier waits for the previous
 * call's readers. */
template <typename T, typename Op> __device__ T dt__block_reduce(T v, Op op)
{
  __shared__ T partial[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int off = 16; off > 0; off >>= 1)
    v = op(v, __shfl_down_sync(0xffffffffu, v, off));
  __syncthreads();
  if (lane == 0)
    partial[warp] = v;
  __syncthreads();
  T r = partial[0];
  for (unsigned w = 1; w < blockDim.x / 32; w++)
    r = op(r, partial[w]);
  return r;
}

#endif
