/* adamw.cu — the AdamW step on the GPU, operation for operation the CPU reference
 * (kernels/cpu/adamw.c), which follows PyTorch's AdamW. */
#include <cuda_runtime.h>
#include <math.h>

#include "cuda_kernels.h"
#include "dt_error.h"

__global__ static void adamw_kernel(float *param, const float *grad, float *m, float *v, size_t n,
                                    float decay, float step_size, float bc2_sqrt, float beta1,
                                    float beta2, float one_m_b1, float one_m_b2, float eps,
                                    float grad_scale)
{
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  float g = grad[i] * grad_scale;
  float p = param[i] * decay;
  float mi = m[i] * beta1 + one_m_b1 * g;
  float vi = v[i] * beta2 + one_m_b2 * g * g;
  float denom = sqrtf(vi) / bc2_sqrt + eps;
  param[i] = p + (-step_size * mi) / denom;
  m[i] = mi;
  v[i] = vi;
}

extern "C" int dt_cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                                    float lr, float beta1, float beta2, float eps,
                                    float weight_decay, float grad_scale, int t)
{
  double bc1 = 1.0 - pow((double)beta1, t);
  double bc2 = 1.0 - pow((double)beta2, t);
  float decay = (float)(1.0 - (double)lr * (double)weight_decay);
  float step_size = (float)((double)lr / bc1);
  const int threads = 256;
  unsigned blocks = (unsigned)((n + threads - 1) / threads);
  if (n == 0)
    return 0;
  adamw_kernel<<<blocks, threads>>>(param, grad, m, v, n, decay, step_size, (float)sqrt(bc2), beta1,
                                    beta2, (float)(1.0 - (double)beta1),
                                    (float)(1.0 - (double)beta2), eps, grad_scale);
  return cudaGetLastError() == cudaSuccess ? 0 : DT_ECUDA;
}
