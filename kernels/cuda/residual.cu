/* residual.cu — the residual add on the GPU, out = a + b (reference: kernels/cpu/residual.c).
 * Its backward is the identity on both inputs, so there is no backward kernel. out may alias a
 * or b (each element is read, then written, by one thread). */
#include "cuda_impl.h"
#include "residual.cuh"

int dt__cuda_residual_forward(struct dt_device *dev, float *out, const float *a, const float *b,
                              size_t n)
{
  if (n == 0)
    return 0;
  residual_forward_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0,
                            dt__cuda(dev)->stream>>>(out, a, b, n);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}
