/* matmul.c — the linear layer, forward and backward, through OpenBLAS cblas_sgemm.
 * PyTorch's nn.Linear convention: weight is (OC, C) and out = inp @ weight^T + bias. */
#include <cblas.h>
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

void dt_cpu_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int ldd)
{
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, ldd, weight, C,
                0.0f, dinp, C);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, ldd, inp, C, 1.0f,
              dweight, C);
  if (!dbias)
    return;
    /* Sum over rows per block of channels, rows in order: thread-count independent. */
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
