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

/* A kernel's dynamic shared memory as float name[] (the host emulation, tests/emul/cuda_emul.h,
 * defines its own). */
#ifndef DT_DYNAMIC_SMEM
#define DT_DYNAMIC_SMEM(name) extern __shared__ float name[]
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

/* An input element as fp32: kernels templated on their input type read through it. */
__device__ static inline float dt__load(const float *p)
{
  return *p;
}

__device__ static inline float dt__load(const __nv_bfloat16 *p)
{
  return __bfloat162float(*p);
}

/* Vectors of DT__VEC elements, for kernels that stream rows or arrays with 16-byte accesses: v =
 * x[0..DT__VEC) as fp32 (one 16-byte load of bf16, two of fp32), and x[0..DT__VEC) = v (bf16:
 * each rounded to nearest even); x 16-byte aligned. */
#define DT__VEC 8

__device__ static inline void dt__load_vec(const float *x, float v[DT__VEC])
{
#ifdef __CUDACC__
  const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
#else
  for (int i = 0; i < DT__VEC; i++)
    v[i] = x[i];
#endif
}

__device__ static inline void dt__load_vec(const __nv_bfloat16 *x, float v[DT__VEC])
{
#ifdef __CUDACC__
  const uint4 u = *(const uint4 *)x;
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; i++) /* a bf16 is the high half of its fp32 */
    v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#else
  for (int i = 0; i < DT__VEC; i++)
    v[i] = __bfloat162float(x[i]);
#endif
}

__device__ static inline void dt__store_vec(float *x, const float v[DT__VEC])
{
#ifdef __CUDACC__
  ((float4 *)x)[0] = make_float4(v[0], v[1], v[2], v[3]);
  ((float4 *)x)[1] = make_float4(v[4], v[5], v[6], v[7]);
#else
  for (int i = 0; i < DT__VEC; i++)
    x[i] = v[i];
#endif
}

__device__ static inline void dt__store_vec(__nv_bfloat16 *x, const float v[DT__VEC])
{
#ifdef __CUDACC__
  unsigned w[4];
  for (int i = 0; i < 4; i++)
    w[i] = (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i])) |
           (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1])) << 16;
  *(uint4 *)x = make_uint4(w[0], w[1], w[2], w[3]);
#else
  for (int i = 0; i < DT__VEC; i++)
    x[i] = __float2bfloat16_rn(v[i]);
#endif
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

/* Combines one value per lane over the calling warp (all 32 lanes must call it); every lane
 * returns the same result: a butterfly of xor shuffles, whose operands differ between lanes
 * only in the order of commutative pairs, so the order is fixed (deterministic) and every lane's
 * bits are equal. */
template <typename T, typename Op> __device__ T dt__warp_reduce(T v, Op op)
{
  for (int off = 16; off > 0; off >>= 1)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

/* The second pass of a column sum: out[z][c] += the sum of in[z]'s rows (rows x cols, row-major)
 * in column c, for the one or two matrices z = blockIdx.z. A block of DT__CSUM_THREADS threads
 * takes DT__CSUM_COLS columns (a warp's coalesced loads of a row): thread (y, x) sums the rows
 * y, y + DT__CSUM_LANES, ... of column x in order, then a fixed tree adds the lanes' sums (y and
 * y + h for h = 16, 8, ..., 1). The order depends on rows only, so the result is the same from
 * run to run; a thread per column adding all the rows had cols threads for the whole GPU and one
 * chain of loads each. Grid (ceil(cols / DT__CSUM_COLS), 1, matrices). */
#define DT__CSUM_COLS    32
#define DT__CSUM_LANES   32
#define DT__CSUM_THREADS (DT__CSUM_COLS * DT__CSUM_LANES)
template <typename T> struct dt__csum {
  T *out[2];
  const T *in[2];
};
typedef dt__csum<float> dt__csum_t;

template <typename T>
__global__ static void dt__column_sums_kernel(dt__csum<T> m, int rows, int cols)
{
  __shared__ T lane_sum[DT__CSUM_LANES][DT__CSUM_COLS + 1];
  const int x = (int)threadIdx.x % DT__CSUM_COLS, y = (int)threadIdx.x / DT__CSUM_COLS;
  const int c = (int)blockIdx.x * DT__CSUM_COLS + x;
  const T *in = m.in[blockIdx.z];
  T s = 0;
  if (c < cols)
    for (int r = y; r < rows; r += DT__CSUM_LANES)
      s += in[(size_t)r * cols + c];
  lane_sum[y][x] = s;
  for (int h = DT__CSUM_LANES / 2; h > 0; h /= 2) {
    __syncthreads();
    if (y < h)
      lane_sum[y][x] += lane_sum[y + h][x];
  }
  if (y == 0 && c < cols)
    m.out[blockIdx.z][c] += lane_sum[0][x];
}

#endif
