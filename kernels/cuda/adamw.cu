/* adamw.cu — the AdamW step on the GPU, operation for operation the CPU reference
 * (kernels/cpu/adamw.c), which follows PyTorch's AdamW: the two give bit-identical results, so
 * a run's optimizer state does not depend on the backend.
 *
 * One kernel, two ways in: dt_cuda_adamw_update (the legacy default stream) and the kernel
 * table's adamw_update (the device's stream). Elementwise, grid-stride over any n. */
#include "cuda_impl.h"
#include "adamw.cuh"

static int adamw_launch(cudaStream_t stream, float *param, void *param16, const float *grad,
                        float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
                        float weight_decay, float grad_scale, int t)
{
  if (n == 0)
    return 0;
  const adamw_scalars_t k = adamw_scalars(lr, beta1, beta2, weight_decay, t);
  adamw_kernel<<<dt__cuda_grid(n, DT__CUDA_THREADS), DT__CUDA_THREADS, 0, stream>>>(
      param, (__nv_bfloat16 *)param16, grad, m, v, n, k.decay, k.step_size, k.bc2_sqrt, beta1,
      beta2, k.one_m_b1, k.one_m_b2, eps, grad_scale);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

extern "C" int dt_cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                                    float lr, float beta1, float beta2, float eps,
                                    float weight_decay, float grad_scale, int t)
{
  return adamw_launch(0, param, NULL, grad, m, v, n, lr, beta1, beta2, eps, weight_decay,
                      grad_scale, t);
}

int dt__cuda_adamw_update(struct dt_device *dev, float *param, void *param16, const float *grad,
                          float *m, float *v, size_t n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, float grad_scale, int t)
{
  return adamw_launch(dt__cuda(dev)->stream, param, param16, grad, m, v, n, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, t);
}
