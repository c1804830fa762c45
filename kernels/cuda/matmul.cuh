/* matmul.cuh — the linear layer's own kernel beside cuBLASLt (matmul.cu launches it,
 * elementwise over a capped grid): the bf16 copies of the GEMM operands. The includer provides __nv_bfloat16 and __float2bfloat16_rn (cuda_bf16.h, or
 * tests/unit/cuda_emul.h on the host). */
#ifndef DT_KERNELS_CUDA_MATMUL_CUH
#define DT_KERNELS_CUDA_MATMUL_CUH

#include "block.cuh"

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
