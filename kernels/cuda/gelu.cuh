/* gelu.cuh — the GELU kernels (gelu.cu launches them, elementwise over a capped grid; its top
 * comment states the expression). Device code only, also compiled for the host by
 * tests/unit/cuda_emul.h. The forward writes fp32, or the same values rounded to bf16 (a bf16
 * activation, ops.h). */
#ifndef DT_KERNELS_CUDA_GELU_CUH
#define DT_KERNELS_CUDA_GELU_CUH

#include <math.h>

#include "block.cuh"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

template <typename O> __global__ static void gelu_forward_kernel(O *out, const float *inp, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    const float x = inp[i];
    const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    dt__store(out + i, 0.5f * x * (1.0f + tanhf(u)));
  }
}

__global__ static void gelu_backward_kernel(float *dinp, const float *inp, const float *dout,
                                            size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    const float x = inp[i];
    const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float local =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = local * dout[i];
  }
}

#endif
