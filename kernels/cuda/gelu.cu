/* gelu.cu — GELU with the tanh approximation (GPT-2's) on the GPU, forward and backward
 * (reference: kernels/cpu/gelu.c, whose expression this follows term by term):
 *   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * Elementwise, grid-stride over any n. The backward's dinp may alias dout: each element is read
 * and then written by the same thread, so the pointers are deliberately not __restrict__. */
#include "cuda_impl.h"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

__global__ static void gelu_forward_kernel(float *out, const float *inp, size_t n)
{
  DT__CUDA_FOR(i, n)
  {
    const float x = inp[i];
    const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    out[i] = 0.5f * x * (1.0f + tanhf(u));
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

int dt__cuda_gelu_forward(struct dt_device *dev, float *out, const float *inp, size_t n)
{
  if (n == 0)
    return 0;
  gelu_forward_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                        dt__cuda(dev)->stream>>>(out, inp, n);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_gelu_backward(struct dt_device *dev, float *dinp, const float *inp, const float *dout,
                           size_t n)
{
  if (n == 0)
    return 0;
  gelu_backward_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                         dt__cuda(dev)->stream>>>(dinp, inp, dout, n);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}
