/* attention.c — causal multi-head self-attention, forward and backward.
 *
 * Each (batch, head) pair is independent and handled by one thread; its products are GEMMs on
 * strided views of the packed qkv rows, through OpenBLAS (single-threaded inside the parallel
 * region). Causality is exploited by blocking the T x T score matrix into row blocks of
 * ATT_BLOCK: row block [r0, r1) only needs key columns [0, r1), which skips ~3/8 of the work
 * at T = 256 instead of computing the full square and masking it.
 *
 * Context parallelism: the _cp variants take the Tq queries at global positions [q0, q0 + Tq)
 * of a sequence whose packed qkv rows hold Tall positions per batch element, against the keys
 * [0, Tk), Tk = q0 + Tq (causal: no later key is needed). With q0 = 0 and Tq = Tk = Tall they
 * are the plain kernels, product for product, except that the _cp backward accumulates (+=)
 * into dqkv: a rank's two query chunks (context_parallel in gpt2.c) add to the same keys.
 *
 * Invariant: att holds the softmax probabilities with exact zeros above the diagonal (inside
 * the diagonal blocks too), because the blocked products read those entries. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vecmath.h"

#define ATT_BLOCK 64

void dt_cpu_attention_forward_cp(float *out, float *att, const float *qkv, int B, int Tq, int q0,
                                 int Tall, int C, int NH)
{
  const int hs = C / NH, C3 = 3 * C, Tk = q0 + Tq;
  const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    int b = bh / NH, h = bh % NH;
    const float *q = qkv + (size_t)b * Tall * C3 + (size_t)h * hs + (size_t)q0 * C3;
    const float *k = qkv + (size_t)b * Tall * C3 + (size_t)h * hs + C;
    const float *v = k + C;
    float *A = att + (size_t)bh * Tq * Tk;
    float *o = out + (size_t)b * Tq * C + (size_t)h * hs;
    for (int r0 = 0; r0 < Tq; r0 += ATT_BLOCK) {
      int r1 = r0 + ATT_BLOCK < Tq ? r0 + ATT_BLOCK : Tq, kn = q0 + r1;
      /* scores[r0:r1, 0:kn] = scale * Q[r0:r1] K[0:kn]^T */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, kn, hs, scale,
                  q + (size_t)r0 * C3, C3, k, C3, 0.0f, A + (size_t)r0 * Tk, Tk);
      for (int t = r0; t < r1; t++) {
        float *row = A + (size_t)t * Tk;
        const int last = q0 + t; /* the query's own position: its last key */
        float maxv = -INFINITY;
        for (int j = 0; j <= last; j++)
          maxv = row[j] > maxv ? row[j] : maxv;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j <= last; j++) {
          row[j] = expf(row[j] - maxv);
          sum += row[j];
        }
        float inv = 1.0f / sum;
        for (int j = 0; j <= last; j++)
          row[j] *= inv;
        memset(row + last + 1, 0, (size_t)(Tk - last - 1) * sizeof(float));
      }
      /* out[r0:r1] = A[r0:r1, 0:kn] V[0:kn] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, kn, 1.0f,
                  A + (size_t)r0 * Tk, Tk, v, C3, 0.0f, o + (size_t)r0 * C, C);
    }
  }
}

void dt_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
  dt_cpu_attention_forward_cp(out, att, qkv, B, T, 0, T, C, NH);
}

/* beta 0: dqkv written (=), 1: accumulated (+=). */
static void attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int Tq, int q0, int Tall, int C, int NH,
                               float beta)
{
  const int hs = C / NH, C3 = 3 * C, Tk = q0 + Tq;
  const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    int b = bh / NH, h = bh % NH;
    const size_t base = (size_t)b * Tall * C3 + (size_t)h * hs;
    const float *q = qkv + base + (size_t)q0 * C3;
    const float *k = qkv + base + C;
    const float *v = k + C;
    float *dq = dqkv + base + (size_t)q0 * C3;
    float *dk = dqkv + base + C;
    float *dv = dk + C;
    const float *A = att + (size_t)bh * Tq * Tk;
    const float *dO = dout + (size_t)b * Tq * C + (size_t)h * hs;
    float *dP = scratch + (size_t)bh * Tq * Tk;

    for (int r0 = 0; r0 < Tq; r0 += ATT_BLOCK) {
      int r1 = r0 + ATT_BLOCK < Tq ? r0 + ATT_BLOCK : Tq, kn = q0 + r1;
      /* dA[r0:r1, 0:kn] = dO[r0:r1] V[0:kn]^T */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, kn, hs, 1.0f,
                  dO + (size_t)r0 * C, C, v, C3, 0.0f, dP + (size_t)r0 * Tk, Tk);
      /* softmax backward, with the 1/sqrt(hs) of the scores folded in:
       * dS = scale * A * (dA - sum_j A dA); zero above the diagonal because A is. The column
       * blocks below read rows past this block's kn only when q0 is not a multiple of the
       * block: then the whole rest of the row is zeroed. */
      const int zero_to = q0 % ATT_BLOCK == 0 ? kn : Tk;
      for (int t = r0; t < r1; t++) {
        const float *a = A + (size_t)t * Tk;
        float *d = dP + (size_t)t * Tk;
        const int last = q0 + t;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j <= last; j++)
          dot += a[j] * d[j];
        for (int j = 0; j <= last; j++)
          d[j] = scale * a[j] * (d[j] - dot);
        for (int j = last + 1; j < zero_to; j++)
          d[j] = 0.0f;
      }
      /* dQ[r0:r1] = dS[r0:r1, 0:kn] K[0:kn] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, kn, 1.0f,
                  dP + (size_t)r0 * Tk, Tk, k, C3, beta, dq + (size_t)r0 * C3, C3);
    }
    /* Column blocks [j0, j1) of dS and A are nonzero only in the rows of queries at or after
     * position j0: local rows t >= j0 - q0. */
    for (int j0 = 0; j0 < Tk; j0 += ATT_BLOCK) {
      int j1 = j0 + ATT_BLOCK < Tk ? j0 + ATT_BLOCK : Tk;
      int t0 = j0 > q0 ? j0 - q0 : 0;
      /* dK[j0:j1] = dS[t0:Tq, j0:j1]^T Q[t0:Tq] */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, Tq - t0, 1.0f,
                  dP + (size_t)t0 * Tk + j0, Tk, q + (size_t)t0 * C3, C3, beta,
                  dk + (size_t)j0 * C3, C3);
      /* dV[j0:j1] = A[t0:Tq, j0:j1]^T dO[t0:Tq] */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, Tq - t0, 1.0f,
                  A + (size_t)t0 * Tk + j0, Tk, dO + (size_t)t0 * C, C, beta, dv + (size_t)j0 * C3,
                  C3);
    }
  }
}

void dt_cpu_attention_backward_cp(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                  const float *att, int B, int Tq, int q0, int Tall, int C, int NH)
{
  attention_backward(dqkv, scratch, dout, qkv, att, B, Tq, q0, Tall, C, NH, 1.0f);
}

void dt_cpu_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH)
{
  attention_backward(dqkv, scratch, dout, qkv, att, B, T, 0, T, C, NH, 0.0f);
}
