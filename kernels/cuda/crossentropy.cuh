/* crossentropy.cuh — the cross-entropy kernels (crossentropy.cu launches them, one block of
 * CE_THREADS per row; its top comment states the arithmetic). Device code only, also compiled
 * for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_CROSSENTROPY_CUH
#define DT_KERNELS_CUDA_CROSSENTROPY_CUH

#include <math.h>

#include "block.cuh"

#define CE_THREADS 512 /* a multiple of 32 */

/* O = __nv_bfloat16: the dlogits as bf16 values, in place from the row's first byte. Value j
 * then lands on the bytes of fp32 value j / 2, which this or an earlier pass of the loop has
 * read: each pass reads its blockDim.x values, waits for the whole block, then writes them. */
template <typename O>
__global__ static void crossentropy_kernel(float *losses, float *logits, const int *targets,
                                           float dloss, int V, int Vp)
{
  const size_t row = blockIdx.x;
  float *x = logits + row * Vp;
  const int tgt = targets[row];
  const float x_tgt = x[tgt];
  float m = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    m = x[j] > m ? x[j] : m;
  m = dt__block_reduce(m, dt__max_op());
  const float xt = x_tgt - m;
  float s = 0.0f;
  if (dloss == 0.0f) {
    for (int j = threadIdx.x; j < V; j += blockDim.x)
      s += expf(x[j] - m);
    s = dt__block_reduce(s, dt__sum_op());
    if (threadIdx.x == 0)
      losses[row] = logf(s) - xt;
    return;
  }
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float e = expf(x[j] - m);
    x[j] = e;
    s += e;
  }
  s = dt__block_reduce(s, dt__sum_op());
  if (threadIdx.x == 0)
    losses[row] = logf(s) - xt;
  const float scale = dloss / s;
  O *out = (O *)x;
  for (int base = 0; base < Vp; base += blockDim.x) { /* the same passes in every thread */
    const int j = base + (int)threadIdx.x;
    float g = 0.0f;
    if (j < V) {
      g = x[j] * scale;
      if (j == tgt)
        g -= dloss;
    }
    __syncthreads();
    if (j < Vp)
      dt__store(out + j, g);
  }
}

/* stats[row] = (local max, local sum of exp(x - max), target logit if held here else 0); a
 * rank holding no columns reports (-inf, 0, 0). */
__global__ static void vp_stats_kernel(float *stats, const float *logits, const int *targets,
                                       int vocab_lo, int Vl, int ldl)
{
  const size_t row = blockIdx.x;
  const float *x = logits + row * ldl;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < Vl; j += blockDim.x)
    m = x[j] > m ? x[j] : m;
  m = dt__block_reduce(m, dt__max_op());
  float s = 0.0f;
  for (int j = threadIdx.x; j < Vl; j += blockDim.x)
    s += expf(x[j] - m);
  s = dt__block_reduce(s, dt__sum_op());
  if (threadIdx.x == 0) {
    const int t = targets[row] - vocab_lo;
    stats[3 * row + 0] = Vl > 0 ? m : -INFINITY;
    stats[3 * row + 1] = s;
    stats[3 * row + 2] = t >= 0 && t < Vl ? x[t] : 0.0f;
  }
}

/* Combines the ranks' triples of one row (every thread computes the same few scalars, in rank
 * order), writes the loss and, when dloss != 0, this rank's dlogits (O = __nv_bfloat16: as bf16
 * values in place, in passes as crossentropy_kernel's). */
template <typename O>
__global__ static void vp_finish_kernel(float *losses, float *logits, const float *all_stats,
                                        int nranks, const int *targets, int vocab_lo, float dloss,
                                        int N, int Vl, int ldl)
{
  const size_t row = blockIdx.x;
  const size_t rstride = 3 * (size_t)N;
  float M = -INFINITY, xt = 0.0f;
  for (int r = 0; r < nranks; r++) {
    const float *st = all_stats + r * rstride + 3 * row;
    M = st[0] > M ? st[0] : M;
    xt += st[2]; /* one rank holds the target, the others add 0 */
  }
  float S = 0.0f;
  for (int r = 0; r < nranks; r++) {
    const float *st = all_stats + r * rstride + 3 * row;
    if (st[0] != -INFINITY)
      S += st[1] * expf(st[0] - M);
  }
  if (threadIdx.x == 0)
    losses[row] = logf(S) - (xt - M);
  if (dloss == 0.0f)
    return;
  float *x = logits + row * ldl;
  const float scale = dloss / S;
  const int t = targets[row] - vocab_lo;
  O *out = (O *)x;
  for (int base = 0; base < ldl; base += blockDim.x) { /* the same passes in every thread */
    const int j = base + (int)threadIdx.x;
    float g = 0.0f;
    if (j < Vl) {
      g = expf(x[j] - M) * scale;
      if (j == t)
        g -= dloss;
    }
    __syncthreads();
    if (j < ldl)
      dt__store(out + j, g);
  }
}

#endif
