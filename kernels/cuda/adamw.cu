/* adamw.cu — the AdamW step on the GPU, operation for operation the CPU reference
 * (kernels/cpu/adamw.c), which follows PyTorch's AdamW: the two give bit-identical results, so
 * a run's optimizer state does not depend on the backend. */
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
  /* Each operation rounds on its own (the _rn intrinsics are never fused into an FMA), in the
   * CPU reference's order: with IEEE sqrt and division the result is bit-identical to it. */
  float g = __fmul_rn(grad[i], grad_scale);
  float p = __fmul_rn(param[i], decay);
  float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(one_m_b1, g));
  float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_m_b2, g), g));
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
  param[i] = __fadd_rn(p, __fdiv_rn(__fmul_rn(-step_size, mi), denom));
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
