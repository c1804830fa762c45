/* adamw.cuh — the AdamW kernel (adamw.cu launches it, elementwise over a capped grid; its top
 * comment says why it is bit-identical to the CPU's) and the scalars it takes, derived on the
 * host. Also compiled for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_ADAMW_CUH
#define DT_KERNELS_CUDA_ADAMW_CUH

#include <math.h>

#include "block.cuh"

/* The kernel's scalars for step t, derived in double on the host exactly as the CPU reference
 * derives them. */
typedef struct {
  float decay, step_size, bc2_sqrt, one_m_b1, one_m_b2;
} adamw_scalars_t;

static inline adamw_scalars_t adamw_scalars(float lr, float beta1, float beta2, float weight_decay,
                                            int t)
{
  const double bc1 = 1.0 - pow((double)beta1, t), bc2 = 1.0 - pow((double)beta2, t);
  const adamw_scalars_t k = {(float)(1.0 - (double)lr * (double)weight_decay),
                             (float)((double)lr / bc1), (float)sqrt(bc2),
                             (float)(1.0 - (double)beta1), (float)(1.0 - (double)beta2)};
  return k;
}

/* param16, where not NULL, gets each new parameter rounded to bf16 (to nearest even). */
__global__ static void adamw_kernel(float *param, __nv_bfloat16 *param16, const float *grad,
                                    float *m, float *v, size_t n, float decay, float step_size,
                                    float bc2_sqrt, float beta1, float beta2, float one_m_b1,
                                    float one_m_b2, float eps, float grad_scale)
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
    const float pn = __fadd_rn(p, __fdiv_rn(__fmul_rn(-step_size, mi), denom));
    param[i] = pn;
    if (param16)
      param16[i] = __float2bfloat16_rn(pn);
    m[i] = mi;
    v[i] = vi;
  }
}

#endif
