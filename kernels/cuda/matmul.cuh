/* matmul.cuh — the linear layer's own kernels beside cuBLASLt (matmul.cu launches them,
 * elementwise over a capped grid): the bf16 copies of the GEMM operands, and the bias seed of
 * the output for a product that cuBLASLt cannot take (see gemm_seeded). The includer provides
 * __nv_bfloat16 and __float2bfloat16_rn (cuda_bf16.h, or tests/unit/cuda_emul.h on the host). */
#ifndef DT_KERNELS_CUDA_MATMUL_CUH
#define DT_KERNELS_CUDA_MATMUL_CUH

#include "block.cuh"

/* out[i, o] = bias[o] for the first OC columns of each row. */
__global__ static void bias_fill_kernel(float *out, const float *bias, int OC, int ldo,
                                        size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    const size_t row = i / (size_t)OC;
    const size_t o = i % (size_t)OC;
    out[row * ldo + o] = bias[o];
  }
}

/* dst (rows x cols, contiguous) = src (row stride lds) rounded to bf16. */
__global__ static void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t cols, size_t lds,
                                      size_t total)
{
  DT__CUDA_FOR(i, total)
  {
    dst[i] = __float2bfloat16_rn(src[(i / cols) * lds + i % cols]);
  }
}

#endif
