/* matmul.cuh — the linear layer's own kernels beside cuBLASLt (matmul.cu launches them): the
 * bf16 copies of the GEMM operands, the bf16 copy of an output gradient together with the bias
 * gradient (its column sums) in one pass (or the column sums alone of a bf16 gradient), and the
 * bias seed of the output for a product that cuBLASLt cannot take (see gemm_seeded). The includer
 * provides __nv_bfloat16 and
 * __float2bfloat16_rn (cuda_bf16.h, or tests/unit/cuda_emul.h on the host). */
#ifndef DT_KERNELS_CUDA_MATMUL_CUH
#define DT_KERNELS_CUDA_MATMUL_CUH

#include "block.cuh"

/* The seed of the linear layer's cuBLAS form: out[i, o] = in[i, o] + bias[o], or either term
 * alone where the other is NULL, for the first OC columns of each row (in laid out like out);
 * B: the bias's type (float, or __nv_bfloat16: a bf16 output's bias). */
template <typename B>
__global__ static void linear_seed_kernel(float *out, const B *bias, const float *in, int OC,
                                          int ldo, size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t at = i / (size_t)OC * ldo + i % (size_t)OC;
    const float b = bias ? dt__load(bias + i % (size_t)OC) : 0.0f;
    out[at] = in ? (bias ? in[at] + b : in[at]) : b;
  }
}

/* dst (total / cols rows of cols values, row stride ldd) = src (row stride lds) rounded to bf16. */
__global__ static void to_bf16_kernel(__nv_bfloat16 *dst, size_t ldd, const float *src, size_t lds,
                                      size_t cols, size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t r = i / cols, c = i % cols;
    dst[r * ldd + c] = __float2bfloat16_rn(src[r * lds + c]);
  }
}

/* The bf16 copy with column sums: blocks of COLSUM_THREADS threads, COLSUM_COLS columns (a warp
 * reads 32 consecutive floats of a row) by COLSUM_LANES row lanes; grid (column tiles, row
 * blocks of rows_per_block rows). */
#define COLSUM_COLS    32
#define COLSUM_LANES   8
#define COLSUM_THREADS (COLSUM_COLS * COLSUM_LANES)
#define COLSUM_ROWS    256 /* rows per block, unless the grid's y limit asks for more */

/* dst (rows x cols, contiguous) = src (row stride lds) rounded to bf16, and partial[y * cols + c]
 * = the sum of src's fp32 column c over row block y: each lane adds its rows in order, then the
 * lanes are added in order, so the sums depend on the shapes only (deterministic). A bf16 src
 * (a gradient that exists in bf16 only) has no copy to make: dst is NULL then. */
template <typename S>
__global__ static void to_bf16_colsum_kernel(__nv_bfloat16 *dst, float *partial, const S *src,
                                             int rows, int cols, int lds, int rows_per_block)
{
  __shared__ float lane_sum[COLSUM_LANES][COLSUM_COLS];
  const int tc = threadIdx.x % COLSUM_COLS, lane = threadIdx.x / COLSUM_COLS;
  const int c = blockIdx.x * COLSUM_COLS + tc, r0 = blockIdx.y * rows_per_block;
  const int r1 = min(r0 + rows_per_block, rows);
  float acc = 0.0f;
  if (c < cols)
    for (int r = r0 + lane; r < r1; r += COLSUM_LANES) {
      const float x = dt__load(src + (size_t)r * lds + c);
      if (dst)
        dst[(size_t)r * cols + c] = __float2bfloat16_rn(x);
      acc += x;
    }
  lane_sum[lane][tc] = acc;
  __syncthreads();
  if (lane == 0 && c < cols) {
    float s = 0.0f;
    for (int j = 0; j < COLSUM_LANES; j++)
      s += lane_sum[j][tc];
    partial[(size_t)blockIdx.y * cols + c] = s;
  }
}

#endif
