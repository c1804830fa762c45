/* gelu.cu — GELU with the tanh approximation (GPT-2's) on the GPU, forward and backward
 * (reference: kernels/cpu/gelu.c, whose expression this follows term by term):
 *   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * Elementwise, grid-stride over any n (under bf16 compute the forward is the fc layer's GEMM
 * epilogue: matmul.cu). The backward's dinp may alias dout: each element is read
 * and then written by the same thread, so the pointers are deliberately not __restrict__. */
#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "gelu.cuh"

int dt__cuda_gelu_forward(struct dt_device *dev, float *out, const float *inp, size_t n)
{
  if (n == 0)
    return 0;
  gelu_forward_kernel<float, float><<<dt__cuda_grid(gelu_threads(n), DT__CUDA_THREADS),
                                      DT__CUDA_THREADS, 0, dt__cuda(dev)->stream>>>(out, inp, n);
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
