/* attention.c — causal multi-head self-attention, forward and backward.
 *
 * Each (batch, head) pair is independent and handled by one thread; its products are GEMMs on
 * strided views of the packed qkv rows, through OpenBLAS (single-threaded inside the parallel
 * region). Causality is exploited by blocking the T x T score matrix into row blocks of
 * ATT_BLOCK: row block [r0, r1) only needs key columns [0, r1), which skips ~3/8 of the work
 * at T = 256 instead of computing the full square and masking it.
 *
 * Invariant: att holds the softmax probabilities with exact zeros above the diagonal (inside
 * the diagonal blocks too), because the blocked products read those entries. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vecmath.h"

#define ATT_BLOCK 64

void dt_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    int b = bh / NH, h = bh % NH;
    const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hs;
    const float *k = q + C;
    const float *v = q + 2 * C;
    float *A = att + (size_t)bh * T * T;
    float *o = out + (size_t)b * T * C + (size_t)h * hs;
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      int r1 = r0 + ATT_BLOCK < T ? r0 + ATT_BLOCK : T;
      /* scores[r0:r1, 0:r1] = scale * Q[r0:r1] K[0:r1]^T */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, scale,
                  q + (size_t)r0 * C3, C3, k, C3, 0.0f, A + (size_t)r0 * T, T);
      for (int t = r0; t < r1; t++) {
        float *row = A + (size_t)t * T;
        float maxv = -INFINITY;
        for (int j = 0; j <= t; j++)
          maxv = row[j] > maxv ? row[j] : maxv;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j <= t; j++) {
          row[j] = expf(row[j] - maxv);
          sum += row[j];
        }
        float inv = 1.0f / sum;
        for (int j = 0; j <= t; j++)
          row[j] *= inv;
        memset(row + t + 1, 0, (size_t)(T - t - 1) * sizeof(float));
      }
      /* out[r0:r1] = A[r0:r1, 0:r1] V[0:r1] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f,
                  A + (size_t)r0 * T, T, v, C3, 0.0f, o + (size_t)r0 * C, C);
    }
  }
}

void dt_cpu_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    int b = bh / NH, h = bh % NH;
    const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hs;
    const float *k = q + C;
    const float *v = q + 2 * C;
    float *dq = dqkv + (size_t)b * T * C3 + (size_t)h * hs;
    float *dk = dq + C;
    float *dv = dq + 2 * C;
    const float *A = att + (size_t)bh * T * T;
    const float *dO = dout + (size_t)b * T * C + (size_t)h * hs;
    float *dP = scratch + (size_t)bh * T * T;

    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      int r1 = r0 + ATT_BLOCK < T ? r0 + ATT_BLOCK : T;
      /* dA[r0:r1, 0:r1] = dO[r0:r1] V[0:r1]^T */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, 1.0f,
                  dO + (size_t)r0 * C, C, v, C3, 0.0f, dP + (size_t)r0 * T, T);
      /* softmax backward, with the 1/sqrt(hs) of the scores folded in:
       * dS = scale * A * (dA - sum_j A dA); zero above the diagonal because A is. */
      for (int t = r0; t < r1; t++) {
        const float *a = A + (size_t)t * T;
        float *d = dP + (size_t)t * T;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j <= t; j++)
          dot += a[j] * d[j];
        for (int j = 0; j <= t; j++)
          d[j] = scale * a[j] * (d[j] - dot);
        for (int j = t + 1; j < r1; j++)
          d[j] = 0.0f;
      }
      /* dQ[r0:r1] = dS[r0:r1, 0:r1] K[0:r1] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f,
                  dP + (size_t)r0 * T, T, k, C3, 0.0f, dq + (size_t)r0 * C3, C3);
    }
    /* Column blocks [j0, j1) of dS and A are nonzero only in rows t >= j0. */
    for (int j0 = 0; j0 < T; j0 += ATT_BLOCK) {
      int j1 = j0 + ATT_BLOCK < T ? j0 + ATT_BLOCK : T;
      /* dK[j0:j1] = dS[j0:T, j0:j1]^T Q[j0:T] */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, T - j0, 1.0f,
                  dP + (size_t)j0 * T + j0, T, q + (size_t)j0 * C3, C3, 0.0f, dk + (size_t)j0 * C3,
                  C3);
      /* dV[j0:j1] = A[j0:T, j0:j1]^T dO[j0:T] */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, T - j0, 1.0f,
                  A + (size_t)j0 * T + j0, T, dO + (size_t)j0 * C, C, 0.0f, dv + (size_t)j0 * C3,
                  C3);
    }
  }
}
