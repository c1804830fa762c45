/* adamw.c — the optimizer step and the gradient norm.
 *
 * The update follows PyTorch's torch.optim.AdamW (single-tensor path) operation by operation,
 * so that fp32 results match it to rounding:
 *   p   *= 1 - lr*wd
 *   m    = beta1*m + (1-beta1)*g
 *   v    = beta2*v + (1-beta2)*g*g
 *   p   += -(lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),   bc_i = 1 - beta_i^t
 * grad_scale folds global-norm clipping into the same pass (1 when not clipping). */
#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"

typedef struct {
  float decay, step_size, bc2_sqrt, beta1, beta2, one_m_b1, one_m_b2, eps, grad_scale;
} adamw_k_t;

/* Element i's update; returns its new parameter. */
static inline float adamw_one(const adamw_k_t *k, float *param, const float *grad, float *m,
                              float *v, size_t i)
{
  float g = grad[i] * k->grad_scale;
  float p = param[i] * k->decay;
  float mi = m[i] * k->beta1 + k->one_m_b1 * g;
  float vi = v[i] * k->beta2 + k->one_m_b2 * g * g;
  float denom = sqrtf(vi) / k->bc2_sqrt + k->eps;
  param[i] = p + (-k->step_size * mi) / denom;
  m[i] = mi;
  v[i] = vi;
  return param[i];
}

void dt_cpu_adamw_update(float *param, float *param16, const float *grad, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, int t)
{
  double bc1 = 1.0 - pow((double)beta1, t);
  double bc2 = 1.0 - pow((double)beta2, t);
  const adamw_k_t k = {.decay = (float)(1.0 - (double)lr * (double)weight_decay),
                       .step_size = (float)((double)lr / bc1),
                       .bc2_sqrt = (float)sqrt(bc2),
                       .beta1 = beta1,
                       .beta2 = beta2,
                       .one_m_b1 = (float)(1.0 - (double)beta1),
                       .one_m_b2 = (float)(1.0 - (double)beta2),
                       .eps = eps,
                       .grad_scale = grad_scale};
  if (param16) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++)
      param16[i] = dt_bf16_round(adamw_one(&k, param, grad, m, v, i));
  } else {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++)
      adamw_one(&k, param, grad, m, v, i);
  }
}

/* Fixed-size blocks summed in order: the result does not depend on the thread count, so
 * clipping (and therefore a resumed run) is reproducible on a machine with other cores. */
#define SUMSQ_BLOCK 16384
double dt_cpu_sum_squares(const float *x, size_t n)
{
  size_t nblocks = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
  double stackbuf[256];
  double *partial = nblocks <= 256 ? stackbuf : malloc(nblocks * sizeof(double));
  if (!partial) /* cannot happen for sane sizes; fall back to one serial pass */
    nblocks = 0;
#pragma omp parallel for schedule(static)
  for (size_t blk = 0; blk < nblocks; blk++) {
    size_t lo = blk * SUMSQ_BLOCK, hi = lo + SUMSQ_BLOCK < n ? lo + SUMSQ_BLOCK : n;
    double acc = 0.0;
    for (size_t i = lo; i < hi; i++)
      acc += (double)x[i] * (double)x[i];
    partial[blk] = acc;
  }
  double total = 0.0;
  if (!partial) {
    for (size_t i = 0; i < n; i++)
      total += (double)x[i] * (double)x[i];
    return total;
  }
  for (size_t blk = 0; blk < nblocks; blk++)
    total += partial[blk];
  if (partial != stackbuf)
    free(partial);
  return total;
}
