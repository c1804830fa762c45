/* crossentropy.cu — softmax + cross-entropy on the GPU: the fused forward/backward over the
 * first V of Vp columns, and the vocabulary-parallel pair (stats, then finish after the
 * tensor-parallel exchange). Reference: kernels/cpu/crossentropy.c, whose arithmetic this
 * follows: fp32 throughout, expf / logf, a max subtracted before exponentiating (here each
 * thread's running max, its sum rescaled as the max grows and once more to the row's: the
 * sums' order and rounding differ from the CPU's, as any parallel sum's).
 *
 * One block per row; max and sum-of-exp are block reductions of fixed shape (deterministic).
 * The backward overwrites the logits in place with dlogits = (softmax - onehot) * dloss, and
 * only when dloss != 0; the padding columns (>= V, or >= Vl up to the row stride) become 0.
 * Every thread reads the target's logit before the first barrier, and no thread writes the row
 * before the reductions' barriers, so the in-place overwrite never races with a read. Threads
 * write only elements they read themselves in the same pass (from the row, or from the block's
 * shared memory where the first pass kept it). Under bf16 the logits and the dlogits written
 * over them are bf16 values (the kernels are templated on the type). */
#include <math.h>

#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "crossentropy.cuh"

/* The backward keeps each row in shared memory between its two passes (one read of the logits
 * where there were two: the same values, so the same bits) where the row takes at most
 * cu->ce_keep_max bytes (half an SM's: two blocks an SM); the forward alone reads it once. */
template <typename T>
static int crossentropy(struct dt_device *dev, float *losses, T *logits, const int *targets,
                        float dloss, int N, int V, int Vp)
{
  dt_cuda_impl_t *cu = dt__cuda(dev);
  if (N <= 0)
    return 0;
  const size_t smem = (size_t)Vp * sizeof(T);
  const int keep = dloss != 0.0f && smem <= cu->ce_keep_max;
  if (keep && smem > 48 * 1024)
    DT_CUDA_CHECK(cudaFuncSetAttribute(crossentropy_kernel<T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  crossentropy_kernel<T><<<(unsigned)N, CE_THREADS, keep ? smem : 0, cu->stream>>>(
      losses, logits, targets, dloss, V, Vp, keep);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_crossentropy_forward_backward(struct dt_device *dev, float *losses, float *logits,
                                           const int *targets, float dloss, int N, int V, int Vp)
{
  return crossentropy(dev, losses, logits, targets, dloss, N, V, Vp);
}

int dt__cuda_crossentropy_forward_backward_bf16(struct dt_device *dev, float *losses, void *logits,
                                                const int *targets, float dloss, int N, int V,
                                                int Vp)
{
  return crossentropy(dev, losses, (__nv_bfloat16 *)logits, targets, dloss, N, V, Vp);
}

/* ------------------------------------------------------------------------------------------ */
/* Vocabulary-parallel cross-entropy (see the CPU reference for the algebra)                    */
/* ------------------------------------------------------------------------------------------ */

template <typename T>
static int vp_stats(struct dt_device *dev, float *stats, const T *logits, const int *targets,
                    int vocab_lo, int N, int Vl, int ldl)
{
  if (N <= 0)
    return 0;
  vp_stats_kernel<T><<<(unsigned)N, CE_THREADS, 0, dt__cuda(dev)->stream>>>(stats, logits, targets,
                                                                            vocab_lo, Vl, ldl);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_crossentropy_vp_stats(struct dt_device *dev, float *stats, const float *logits,
                                   const int *targets, int vocab_lo, int N, int Vl, int ldl)
{
  return vp_stats(dev, stats, logits, targets, vocab_lo, N, Vl, ldl);
}

int dt__cuda_crossentropy_vp_stats_bf16(struct dt_device *dev, float *stats, const void *logits,
                                        const int *targets, int vocab_lo, int N, int Vl, int ldl)
{
  return vp_stats(dev, stats, (const __nv_bfloat16 *)logits, targets, vocab_lo, N, Vl, ldl);
}

template <typename T>
static int vp_finish(struct dt_device *dev, float *losses, T *logits, const float *all_stats,
                     int nranks, const int *targets, int vocab_lo, float dloss, int N, int Vl,
                     int ldl)
{
  if (N <= 0)
    return 0;
  vp_finish_kernel<T><<<(unsigned)N, CE_THREADS, 0, dt__cuda(dev)->stream>>>(
      losses, logits, all_stats, nranks, targets, vocab_lo, dloss, N, Vl, ldl);
  DT_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int dt__cuda_crossentropy_vp_finish(struct dt_device *dev, float *losses, float *logits,
                                    const float *all_stats, int nranks, const int *targets,
                                    int vocab_lo, float dloss, int N, int Vl, int ldl)
{
  return vp_finish(dev, losses, logits, all_stats, nranks, targets, vocab_lo, dloss, N, Vl, ldl);
}

int dt__cuda_crossentropy_vp_finish_bf16(struct dt_device *dev, float *losses, void *logits,
                                         const float *all_stats, int nranks, const int *targets,
                                         int vocab_lo, float dloss, int N, int Vl, int ldl)
{
  return vp_finish(dev, losses, (__nv_bfloat16 *)logits, all_stats, nranks, targets, vocab_lo,
                   dloss, N, Vl, ldl);
}

extern "C" size_t dt_cuda_set_ce_keep_max(dt_device_t *dev, size_t bytes)
{
  const size_t was = dt__cuda(dev)->ce_keep_max;
  dt__cuda(dev)->ce_keep_max = bytes;
  return was;
}
