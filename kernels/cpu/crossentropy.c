/* crossentropy.c — fused softmax + cross-entropy, forward and backward in one pass over the
 * logits, which are the largest activation (N x Vp): the backward overwrites them in place
 * with dlogits, so no probability buffer is ever allocated. Only the first V columns take part
 * (llm.c's padded vocabulary); padded columns get a zero gradient. */
#include <math.h>

#include "cpu_kernels.h"
#include "vecmath.h"

void dt_cpu_crossentropy_forward_backward(float *losses, float *logits, const int *targets,
                                          float dloss, int N, int V, int Vp)
{
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; i++) {
    float *x = logits + (size_t)i * Vp;
    const int tgt = targets[i];
    float maxv = x[0];
    for (int j = 1; j < V; j++)
      maxv = x[j] > maxv ? x[j] : maxv;
    const float xt = x[tgt] - maxv;
    float sum = 0.0f;
    if (dloss == 0.0f) {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < V; j++)
        sum += expf(x[j] - maxv);
      losses[i] = logf(sum) - xt;
      continue;
    }
    /* exp once, in place; then scale into dlogits */
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < V; j++) {
      x[j] = expf(x[j] - maxv);
      sum += x[j];
    }
    losses[i] = logf(sum) - xt;
    const float scale = dloss / sum;
#pragma omp simd
    for (int j = 0; j < V; j++)
      x[j] *= scale;
    x[tgt] -= dloss;
    for (int j = V; j < Vp; j++)
      x[j] = 0.0f;
  }
}

/* Vocabulary-parallel cross-entropy (Megatron): each rank holds the logits of its columns
 * [vocab_lo, vocab_lo + Vl) only. Pass one: per row, the local max m, the local sum
 * s = sum_j exp(x_j - m) and the target's logit when this rank holds the target (0 otherwise).
 * Those triples are exchanged (one all-gather of 3N floats over the tensor-parallel group);
 * pass two combines them: M = max m_r, S = sum s_r exp(m_r - M), loss = log S + M - x_t. No
 * rank ever holds the full-vocabulary logits. */
void dt_cpu_crossentropy_vp_stats(float *stats, const float *logits, const int *targets,
                                  int vocab_lo, int N, int Vl, int ldl)
{
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; i++) {
    const float *x = logits + (size_t)i * ldl;
    float maxv = -INFINITY, sum = 0.0f;
    for (int j = 0; j < Vl; j++)
      maxv = x[j] > maxv ? x[j] : maxv;
    if (Vl > 0) {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < Vl; j++)
        sum += expf(x[j] - maxv);
    }
    const int t = targets[i] - vocab_lo;
    stats[3 * (size_t)i + 0] = Vl > 0 ? maxv : -INFINITY;
    stats[3 * (size_t)i + 1] = sum;
    stats[3 * (size_t)i + 2] = t >= 0 && t < Vl ? x[t] : 0.0f;
  }
}

void dt_cpu_crossentropy_vp_finish(float *losses, float *logits, const float *all_stats, int nranks,
                                   const int *targets, int vocab_lo, float dloss, int N, int Vl,
                                   int ldl)
{
  const size_t rstride = 3 * (size_t)N;
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; i++) {
    float M = -INFINITY, xt = 0.0f;
    for (int r = 0; r < nranks; r++) {
      const float *st = all_stats + r * rstride + 3 * (size_t)i;
      M = st[0] > M ? st[0] : M;
      xt += st[2]; /* one rank holds the target, the others add 0 */
    }
    float S = 0.0f;
    for (int r = 0; r < nranks; r++) {
      const float *st = all_stats + r * rstride + 3 * (size_t)i;
      if (st[0] != -INFINITY)
        S += st[1] * expf(st[0] - M);
    }
    losses[i] = logf(S) - (xt - M);
    if (dloss == 0.0f)
      continue;
    float *x = logits + (size_t)i * ldl;
    const float scale = dloss / S;
#pragma omp simd
    for (int j = 0; j < Vl; j++)
      x[j] = expf(x[j] - M) * scale;
    const int t = targets[i] - vocab_lo;
    if (t >= 0 && t < Vl)
      x[t] -= dloss;
    for (int j = Vl; j < ldl; j++)
      x[j] = 0.0f;
  }
}
