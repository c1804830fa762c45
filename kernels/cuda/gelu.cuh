/* gelu.cuh — the GELU kernels (gelu.cu launches them, elementwise over a capped grid; its top
 * comment states the expression). Device code only, also compiled for the host by
 * tests/unit/cuda_emul.h. The forward reads fp32 and writes fp32, or reads a bf16 activation
 * (ops.h) and writes its values rounded to bf16; the bf16 backward is cuBLASLt's epilogue
 * (matmul.cu), or dgelu_to_bf16_kernel where cuBLASLt has no algorithm for it. */
#ifndef DT_KERNELS_CUDA_GELU_CUH
#define DT_KERNELS_CUDA_GELU_CUH

#include <math.h>

#include "block.cuh"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

template <typename I, typename O>
__global__ static void gelu_forward_kernel(O *out, const I *inp, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    const float x = dt__load(inp + i);
    const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    dt__store(out + i, 0.5f * x * (1.0f + tanhf(u)));
  }
}

__device__ static inline float gelu_grad(float x)
{
  const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}

__global__ static void gelu_backward_kernel(float *dinp, const float *inp, const float *dout,
                                            size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    dinp[i] = gelu_grad(inp[i]) * dout[i];
  }
}

/* dinp = dout * gelu'(inp), rounded to bf16, inp a bf16 activation: the bf16 linear layer's
 * GELU-gradient epilogue as a pass of its own (dout the fp32 product). */
__global__ static void dgelu_to_bf16_kernel(__nv_bfloat16 *dinp, const __nv_bfloat16 *inp,
                                            const float *dout, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    dinp[i] = __float2bfloat16_rn(gelu_grad(__bfloat162float(inp[i])) * dout[i]);
  }
}

#endif
