/* crossentropy.cuh — the cross-entropy kernels (crossentropy.cu launches them, one block of
 * CE_THREADS per row; its top comment states the arithmetic). Device code only, also compiled
 * for the host by tests/unit/cuda_emul.h. */
#ifndef DT_KERNELS_CUDA_CROSSENTROPY_CUH
#define DT_KERNELS_CUDA_CROSSENTROPY_CUH

#include <math.h>

#include "block.cuh"

#define CE_THREADS 512 /* a multiple of 32 */

/* T: the logits' element type (float, or __nv_bfloat16 under bf16 compute: the LM head's bf16
 * output), read as fp32; the dlogits overwrite them in place in the same type, each thread
 * writing only the elements it read itself (the same stride mapping in every loop). The exps are
 * computed again for the gradient rather than kept in place: a bf16 row could not hold them. */
template <typename T>
__global__ static void crossentropy_kernel(float *losses, T *logits, const int *targets,
                                           float dloss, int V, int Vp)
{
  const size_t row = blockIdx.x;
  T *x = logits + row * Vp;
  const int tgt = targets[row];
  const float x_tgt = dt__load(x + tgt);
  float m = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = dt__load(x + j);
    m = v > m ? v : m;
  }
  m = dt__block_reduce(m, dt__max_op());
  const float xt = x_tgt - m;
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    s += expf(dt__load(x + j) - m);
  s = dt__block_reduce(s, dt__sum_op());
  if (threadIdx.x == 0)
    losses[row] = logf(s) - xt;
  if (dloss == 0.0f)
    return;
  const float scale = dloss / s;
  for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
    float g = 0.0f;
    if (j < V) {
      g = expf(dt__load(x + j) - m) * scale;
      if (j == tgt)
        g -= dloss;
    }
    dt__store(x + j, g);
  }
}

/* stats[row] = (local max, local sum of exp(x - max), target logit if held here else 0); a
 * rank holding no columns reports (-inf, 0, 0). */
template <typename T>
__global__ static void vp_stats_kernel(float *stats, const T *logits, const int *targets,
                                       int vocab_lo, int Vl, int ldl)
{
  const size_t row = blockIdx.x;
  const T *x = logits + row * ldl;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < Vl; j += blockDim.x) {
    const float v = dt__load(x + j);
    m = v > m ? v : m;
  }
  m = dt__block_reduce(m, dt__max_op());
  float s = 0.0f;
  for (int j = threadIdx.x; j < Vl; j += blockDim.x)
    s += expf(dt__load(x + j) - m);
  s = dt__block_reduce(s, dt__sum_op());
  if (threadIdx.x == 0) {
    const int t = targets[row] - vocab_lo;
    stats[3 * row + 0] = Vl > 0 ? m : -INFINITY;
    stats[3 * row + 1] = s;
    stats[3 * row + 2] = t >= 0 && t < Vl ? dt__load(x + t) : 0.0f;
  }
}

/* Combines the ranks' triples of one row (every thread computes the same few scalars, in rank
 * order), writes the loss and, when dloss != 0, this rank's dlogits in place (T as
 * crossentropy_kernel's). */
template <typename T>
__global__ static void vp_finish_kernel(float *losses, T *logits, const float *all_stats,
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
  T *x = logits + row * ldl;
  const float scale = dloss / S;
  const int t = targets[row] - vocab_lo;
  for (int j = threadIdx.x; j < ldl; j += blockDim.x) {
    float g = 0.0f;
    if (j < Vl) {
      g = expf(dt__load(x + j) - M) * scale;
      if (j == t)
        g -= dloss;
    }
    dt__store(x + j, g);
  }
}

#endif
