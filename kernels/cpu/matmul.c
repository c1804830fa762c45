/* matmul.c — the linear layer, forward and backward, through OpenBLAS cblas_sgemm.
 * PyTorch's nn.Linear convention: weight is (OC, C) and out = inp @ weight^T + bias. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

void dt_cpu_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC, int ldo)
{
  float beta = 0.0f;
  if (bias) {
    /* Seed every output row with the bias and let the GEMM accumulate onto it. */
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++)
      memcpy(out + (size_t)i * ldo, bias, (size_t)OC * sizeof(float));
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out,
              ldo);
}

/* dbias += the column sums of dout over rows, per block of channels with rows in order:
 * thread-count independent. */
static void bias_backward(float *dbias, const float *dout, int N, int OC, int ldd)
{
#pragma omp parallel for schedule(static)
  for (int o0 = 0; o0 < OC; o0 += DT_CPU_CBLOCK) {
    int o1 = o0 + DT_CPU_CBLOCK < OC ? o0 + DT_CPU_CBLOCK : OC;
    float acc[DT_CPU_CBLOCK] = {0};
    for (int i = 0; i < N; i++) {
      const float *g = dout + (size_t)i * ldd;
      for (int o = o0; o < o1; o++)
        acc[o - o0] += g[o];
    }
    for (int o = o0; o < o1; o++)
      dbias[o] += acc[o - o0];
  }
}

void dt_cpu_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int ldd)
{
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, ldd, weight, C,
                0.0f, dinp, C);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, ldd, inp, C, 1.0f,
              dweight, C);
  if (dbias)
    bias_backward(dbias, dout, N, OC, ldd);
}

float *dt_cpu_bf16_copy(const float *src, size_t rows, size_t cols, size_t lds)
{
  float *dst = malloc(rows * cols * sizeof *dst);
  if (!dst)
    return NULL;
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++)
      dst[i * cols + j] = dt_bf16_round(src[i * lds + j]);
  return dst;
}

void dt_cpu_to_bf16(float *dst, const float *src, size_t n)
{
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++)
    dst[i] = dt_bf16_round(src[i]);
}

int dt_cpu_matmul_forward_bf16(float *out, const float *inp, const float *weight,
                               const float *weight16, const float *bias, int N, int C, int OC,
                               int ldo)
{
  float *w = weight16 ? NULL : dt_cpu_bf16_copy(weight, (size_t)OC, (size_t)C, (size_t)C);
  const float *w16 = weight16 ? weight16 : w;
  if (w16)
    dt_cpu_matmul_forward(out, inp, w16, bias, N, C, OC, ldo);
  free(w);
  return w16 ? 0 : -1;
}

int dt_cpu_matmul_backward_bf16(float *dinp, int dinp16, float *dweight, float *dbias,
                                const float *dout, const float *dout16, const float *inp,
                                const float *weight, const float *weight16, const float *gelu_in,
                                int N, int C, int OC, int ldd)
{
  float *g = dout16 ? NULL : dt_cpu_bf16_copy(dout, (size_t)N, (size_t)OC, (size_t)ldd);
  float *w = dinp && !weight16 ? dt_cpu_bf16_copy(weight, (size_t)OC, (size_t)C, (size_t)C) : NULL;
  const float *w16 = weight16 ? weight16 : w;
  const int ok = (g || dout16) && (w16 || !dinp);
  if (ok)
    dt_cpu_matmul_backward(dinp, dweight, NULL, dout16 ? dout16 : g, inp, w16, N, C, OC,
                           dout16 ? ldd : OC);
  if (ok && dinp && gelu_in) /* the pre-activation's gradient */
    dt_cpu_gelu_backward(dinp, gelu_in, dinp, (size_t)N * C);
  if (ok && dinp && dinp16) /* a bf16 activation gradient */
    dt_cpu_to_bf16(dinp, dinp, (size_t)N * C);
  if (ok && dbias) /* from the unrounded gradient where there is one, as ops.h says */
    bias_backward(dbias, dout ? dout : dout16, N, OC, ldd);
  free(g);
  free(w);
  return ok ? 0 : -1;
}
