/* adamw.cu — the AdamW step on the GPU, operation for operation the CPU reference
 * (kernels/cpu/adamw.c), which follows PyTorch's AdamW: the two give bit-identical results, so
 * a run's optimizer state does not depend on the backend.
 *
 * One kernel, two ways in: dt_cuda_adamw_update (the legacy default stream) and the kernel
 * table's adamw_update (the device's stream). Elementwise, grid-stride over any n. */
#include <math.h>

#include "cuda_impl.h"

__global__ static void adamw_kernel(float *param, const float *grad, float *m, float *v, size_t n,
                                    float decay, float step_size, float bc2_sqrt, float beta1,
                                    float beta2, float one_m_b1, float one_m_b2, float eps,
                                    float grad_scale)
{
  DT__CUDA_FOR(i, n)
  {
    /* Each operation rounds on its own (the _rn intrinsics are never fused into an FMA), in
     * the CPU reference's order: with IEEE sqrt and division the result is bit-identical. */
    float g = __fmul_rn(grad[i], grad_scale);
    float p = __fmul_rn(param[i], decay);
    float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(one_m_b1, g));
    float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_m_b2, g), g));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    param[i] = __fadd_rn(p, __fdiv_rn(__fmul_rn(-step_size, mi), denom));
    m[i] = mi;
    v[i] = vi;
  }
}

/* The scalars are derived in double on the host exactly as the CPU reference derives them. */
static int adamw_launch(cudaStream_t stream, float *param, const float *grad, float *m, float *v,
                        size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                        float grad_scale, int t)
{
  if (n == 0)
    return 0;
  double bc1 = 1.0 - pow((double)beta1, t);
  double bc2 = 1.0 - pow((double)beta2, t);
  float decay = (float)(1.0 - (double)lr * (double)weight_decay);
  float step_size = (float)((double)lr / bc1);
  adamw_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, stream>>>(
      param, grad, m, v, n, decay, step_size, (float)sqrt(bc2), beta1, beta2,
      (float)(1.0 - (double)beta1), (float)(1.0 - (double)beta2), eps, grad_scale);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

extern "C" int dt_cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                                    float lr, float beta1, float beta2, float eps,
                                    float weight_decay, float grad_scale, int t)
{
  return adamw_launch(0, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
}

int dt__cuda_adamw_update(struct dt_device *dev, float *param, const float *grad, float *m,
                          float *v, size_t n, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, int t)
{
  return adamw_launch(dt__cuda(dev)->stream, param, grad, m, v, n, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, t);
}
