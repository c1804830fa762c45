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
