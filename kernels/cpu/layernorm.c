/* layernorm.c — LayerNorm over the channel dimension (eps 1e-5), forward and backward.
 * Statistics are computed two-pass (mean, then variance of the centred values) in float, the
 * way PyTorch's CPU kernel keeps them accurate for C in the thousands. */
#include <math.h>

#include "cpu_kernels.h"

#define LN_EPS 1e-5f

/* One row: o = (x - mean) * rstd * weight + bias, its statistics stored. */
static inline void layernorm_row(float *o, float *mean, float *rstd, const float *x,
                                 const float *weight, const float *bias, int C)
{
  float m = 0.0f;
  for (int c = 0; c < C; c++)
    m += x[c];
  m /= (float)C;
  float v = 0.0f;
  for (int c = 0; c < C; c++) {
    float d = x[c] - m;
    v += d * d;
  }
  v /= (float)C;
  float s = 1.0f / sqrtf(v + LN_EPS);
  for (int c = 0; c < C; c++)
    o[c] = (x[c] - m) * s * weight[c] + bias[c];
  *mean = m;
  *rstd = s;
}

void dt_cpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; i++)
    layernorm_row(out + (size_t)i * C, mean + i, rstd + i, inp + (size_t)i * C, weight, bias, C);
}

/* Row by row, so that the LayerNorm reads the sum while it is still in cache: the same bits
 * as dt_cpu_residual_forward followed by dt_cpu_layernorm_forward. */
void dt_cpu_residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C)
{
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; i++) {
    float *r = res + (size_t)i * C;
    const float *ai = a + (size_t)i * C, *bi = b + (size_t)i * C;
    for (int c = 0; c < C; c++)
      r[c] = ai[c] + bi[c];
    layernorm_row(out + (size_t)i * C, mean + i, rstd + i, r, weight, bias, C);
  }
}

/* dinp is computed in parallel over rows. dweight/dbias are reductions over rows; they are
 * computed in parallel over blocks of channels, each block summing its rows in order, so the
 * result is bit-identical whatever the thread count. (OpenBLAS's GEMMs are not: their rounding
 * changes with the thread count, so bit-identical resume needs the same --threads.) */
void dt_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C)
{
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int i = 0; i < N; i++) {
      const float *x = inp + (size_t)i * C;
      const float *g = dout + (size_t)i * C;
      float *dx = dinp + (size_t)i * C;
      float m = mean[i], s = rstd[i];
      float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
      for (int c = 0; c < C; c++) {
        float norm = (x[c] - m) * s;
        float dnorm = weight[c] * g[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= (float)C;
      dnorm_norm_mean /= (float)C;
      for (int c = 0; c < C; c++) {
        float norm = (x[c] - m) * s;
        float dnorm = weight[c] * g[c];
        dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
#pragma omp for schedule(static)
    for (int c0 = 0; c0 < C; c0 += DT_CPU_CBLOCK) {
      int c1 = c0 + DT_CPU_CBLOCK < C ? c0 + DT_CPU_CBLOCK : C;
      float dw[DT_CPU_CBLOCK] = {0}, db[DT_CPU_CBLOCK] = {0};
      for (int i = 0; i < N; i++) {
        const float *x = inp + (size_t)i * C;
        const float *g = dout + (size_t)i * C;
        float m = mean[i], s = rstd[i];
        for (int c = c0; c < c1; c++) {
          db[c - c0] += g[c];
          dw[c - c0] += (x[c] - m) * s * g[c];
        }
      }
      for (int c = c0; c < c1; c++) {
        dweight[c] += dw[c - c0];
        dbias[c] += db[c - c0];
      }
    }
  }
}
