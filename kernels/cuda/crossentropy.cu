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
 * write only elements they read themselves in the same pass. Under bf16 the logits
 * and the dlogits written over them are bf16 values (the kernels are templated on the type). */
#include <math.h>

#include <cuda_bf16.h>

#include "cuda_impl.h"
#include "crossentropy.cuh"

template <typename T>
static int crossentropy(struct dt_device *dev, float *losses, T *logits, const int *targets,
                        float dloss, int N, int V, int Vp)
{
  if (N <= 0)
    return 0;
  crossentropy_kernel<T><<<(unsigned)N, CE_THREADS, 0, dt__cuda(dev)->stream>>>(
      losses, logits, targets, dloss, V, Vp);
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
